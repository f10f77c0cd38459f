# RetinaNet VVT-S, COCO 3x+MS.
# Paper numbers: none (the VVT paper reports no detection results).
_base_ = ['./_base_/retinanet_3x_ms.py', './_base_/vvt.py']
model = dict(
    backbone=dict(_base_.sizes.s.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.s.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.s
