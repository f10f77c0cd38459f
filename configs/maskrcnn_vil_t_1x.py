# Mask R-CNN ViL-T, COCO 1x.
# Paper numbers (ViL, Table 7): 26.9M params, 41.4 / 38.1 box / mask AP.
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vil.py']
model = dict(backbone=_base_.sizes.t.backbone, neck=dict(in_channels=_base_.sizes.t.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.t
