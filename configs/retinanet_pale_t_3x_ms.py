# RetinaNet Pale-T, COCO 3x+MS.
# Paper numbers: none (the Pale paper reports Mask R-CNN 1x only).
_base_ = ['./_base_/retinanet_3x_ms.py', './_base_/pale.py']
model = dict(
    backbone=dict(_base_.sizes.t.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.t.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.t
