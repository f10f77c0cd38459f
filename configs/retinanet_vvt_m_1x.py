# RetinaNet VVT-M, COCO 1x.
# Paper numbers: none (the VVT paper reports no detection results).
_base_ = ['./_base_/retinanet_1x.py', './_base_/vvt.py']
model = dict(
    backbone=dict(_base_.sizes.m.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.m.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.m
