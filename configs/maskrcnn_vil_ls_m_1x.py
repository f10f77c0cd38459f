# Mask R-CNN ViL-LS-Medium (Transformer-LS: long-short attention in stages 1-2, ViL
# sliding-chunk attention in stages 3-4), COCO 1x. The Transformer-LS paper reports no
# detection or segmentation numbers (its conclusion names them future work; SPEC 5), so
# there is no paper target: results from this config would be new.
# Recipe: the ViL detection recipe of ./_base_/maskrcnn_vil_1x.py; drop path 0.3 (SPEC 1.6:
# 0.2-0.3 for M/B; the LS-Medium ImageNet run also used 0.3). DualLN layers are LayerNorms,
# so norm_decay_mult=0 already keeps them out of weight decay; the LS window tables match
# the base's 'relative_position' key.
_base_ = ['./_base_/maskrcnn_vil_1x.py']
model = dict(
    backbone=dict(type='ViLLS', arch='medium', window_size=7, dp_rank=8, drop_path_rate=0.3),
    neck=dict(in_channels=[96, 192, 384, 768]))
