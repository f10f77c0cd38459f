# RetinaNet Pale-S, COCO 1x.
# Paper numbers: none (the Pale paper reports Mask R-CNN 1x only).
_base_ = ['./_base_/retinanet_1x.py', './_base_/pale.py']
model = dict(
    backbone=dict(_base_.sizes.s.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.s.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.s
