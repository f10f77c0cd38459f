# Mask R-CNN ViL-B, COCO 3x+MS.
# Paper numbers (ViL, Table 7; ImageNet-21k pretraining): 76.1M params, 49.6 / 44.5 box / mask AP.
_base_ = ['./_base_/maskrcnn_3x_ms.py', './_base_/vil.py']
model = dict(backbone=_base_.sizes.b.backbone, neck=dict(in_channels=_base_.sizes.b.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.b
