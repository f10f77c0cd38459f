# RetinaNet VVT-T, COCO 1x.
# Paper numbers: none (the VVT paper reports no detection results).
_base_ = ['./_base_/retinanet_1x.py', './_base_/vvt.py']
model = dict(
    backbone=dict(_base_.sizes.t.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.t.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.t
