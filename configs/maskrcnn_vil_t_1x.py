# Mask R-CNN ViL-Tiny, COCO 1x. Paper (Table 6): 41.4 box AP / 38.1 mask AP, 26.9M params.
_base_ = ['./_base_/maskrcnn_vil_1x.py']
model = dict(backbone=dict(arch='tiny', drop_path_rate=0.1), neck=dict(in_channels=[48, 96, 192, 384]))
