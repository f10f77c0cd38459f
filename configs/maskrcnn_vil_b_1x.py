# Mask R-CNN ViL-B, COCO 1x.
# Paper numbers (ViL, Table 7; ImageNet-21k pretraining): 76.1M params, 48.6 / 43.6 box / mask AP.
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vil.py']
model = dict(backbone=_base_.sizes.b.backbone, neck=dict(in_channels=_base_.sizes.b.dims))
# Base: lr 8e-5 (ViL paper Table 10); official detectron2 Mask R-CNN configs clip at 0.5.
optim_wrapper = dict(optimizer=dict(lr=8e-5), clip_grad=dict(max_norm=0.5, norm_type=2))
