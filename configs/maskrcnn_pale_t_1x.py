# Mask R-CNN Pale-T, COCO 1x.
# Paper numbers (Pale, Table 3): 41M params, 47.4 / 42.7 box / mask AP.
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/pale.py']
model = dict(backbone=_base_.sizes.t.backbone, neck=dict(in_channels=_base_.sizes.t.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.t
