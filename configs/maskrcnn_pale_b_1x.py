# Mask R-CNN Pale-B, COCO 1x.
# Paper numbers (Pale, Table 3): 105M params, 49.3 / 44.2 box / mask AP.
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/pale.py']
model = dict(backbone=_base_.sizes.b.backbone, neck=dict(in_channels=_base_.sizes.b.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.b
