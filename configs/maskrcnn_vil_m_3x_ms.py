# Mask R-CNN ViL-M, COCO 3x+MS.
# Paper numbers (ViL, Table 7; ImageNet-21k pretraining): 60.1M params, 48.9 / 44.2 box / mask AP.
_base_ = ['./_base_/maskrcnn_3x_ms.py', './_base_/vil.py']
model = dict(backbone=_base_.sizes.m.backbone, neck=dict(in_channels=_base_.sizes.m.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.m
