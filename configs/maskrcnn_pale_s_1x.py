# Mask R-CNN Pale-S, COCO 1x.
# Paper numbers (Pale, Table 3): 68M params, 48.4 / 43.7 box / mask AP.
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/pale.py']
model = dict(backbone=_base_.sizes.s.backbone, neck=dict(in_channels=_base_.sizes.s.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.s
