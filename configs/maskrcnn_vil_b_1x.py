# Mask R-CNN ViL-B, COCO 1x.
# Paper numbers (ViL, Table 7; ImageNet-21k pretraining): 76.1M params, 48.6 / 43.6 box / mask AP.
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vil.py']
model = dict(backbone=_base_.sizes.b.backbone, neck=dict(in_channels=_base_.sizes.b.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.b
