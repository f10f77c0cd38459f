# Mask R-CNN VVT-T, COCO 3x+MS.
# Paper numbers: none (the VVT paper reports no detection results).
_base_ = ['./_base_/maskrcnn_3x_ms.py', './_base_/vvt.py']
model = dict(backbone=_base_.sizes.t.backbone, neck=dict(in_channels=_base_.sizes.t.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.t
