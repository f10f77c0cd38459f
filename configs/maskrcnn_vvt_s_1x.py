# Mask R-CNN VVT-S, COCO 1x.
# Paper numbers: none (the VVT paper reports no detection results).
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vvt.py']
model = dict(backbone=_base_.sizes.s.backbone, neck=dict(in_channels=_base_.sizes.s.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.s
