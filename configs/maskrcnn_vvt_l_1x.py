# Mask R-CNN VVT-L, COCO 1x.
# Paper numbers: none (the VVT paper reports no detection results).
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vvt.py']
model = dict(backbone=_base_.sizes.l.backbone, neck=dict(in_channels=_base_.sizes.l.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.l
