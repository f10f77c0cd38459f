# Mask R-CNN ViL-S, COCO 3x+MS.
# Paper numbers (ViL, Table 7): 45.0M params, 47.1 / 42.7 box / mask AP.
_base_ = ['./_base_/maskrcnn_3x_ms.py', './_base_/vil.py']
model = dict(backbone=_base_.sizes.s.backbone, neck=dict(in_channels=_base_.sizes.s.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.s
