# Mask R-CNN ViL-LS-B, COCO 1x.
# Paper numbers: none (the Transformer-LS paper reports no dense prediction: its Sec. 5 leaves it to future work).
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vil.py']
model = dict(backbone=_base_.ls_sizes.b.backbone, neck=dict(in_channels=_base_.ls_sizes.b.dims))
# Base: lr 8e-5 (ViL paper Table 10); official detectron2 Mask R-CNN configs clip at 0.5.
optim_wrapper = dict(optimizer=dict(lr=8e-5), clip_grad=dict(max_norm=0.5, norm_type=2))
