# Mask R-CNN ViL-B, COCO 3x+MS.
# Paper numbers (ViL, Table 7; ImageNet-21k pretraining): 76.1M params, 49.6 / 44.5 box / mask AP.
_base_ = ['./_base_/maskrcnn_3x_ms.py', './_base_/vil.py']
model = dict(backbone=_base_.sizes.b.backbone, neck=dict(in_channels=_base_.sizes.b.dims))
# Base: lr 8e-5 (ViL paper Table 10); official detectron2 Mask R-CNN configs clip at 0.5.
optim_wrapper = dict(optimizer=dict(lr=8e-5), clip_grad=dict(max_norm=0.5, norm_type=2))
