# Mask R-CNN ViL-S, COCO 1x.
# Paper numbers (ViL, Table 7): 45.0M params, 44.9 / 41.0 box / mask AP.
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vil.py']
model = dict(backbone=_base_.sizes.s.backbone, neck=dict(in_channels=_base_.sizes.s.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.s
