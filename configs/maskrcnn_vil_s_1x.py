# Mask R-CNN ViL-Small, COCO 1x. Paper (Table 6): 44.9 box AP / 41.0 mask AP, 45.0M params.
_base_ = ['./_base_/maskrcnn_vil_1x.py']
model = dict(backbone=dict(arch='small', drop_path_rate=0.2), neck=dict(in_channels=[96, 192, 384, 768]))
