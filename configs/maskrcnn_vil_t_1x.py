# Mask R-CNN ViL-T, COCO 1x.
# Paper numbers (ViL, Table 7): 26.9M params, 41.4 / 38.1 box / mask AP.
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vil.py']
model = dict(
    backbone=dict(
        _base_.vil_backbone,
        arch='tiny',
        drop_path_rate=0.1,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vil_tiny.pth'),
    ),
    neck=dict(in_channels=[48, 96, 192, 384]),
)
optim_wrapper = dict(clip_grad=dict(max_norm=0.5, norm_type=2))  # official detectron2 Mask R-CNN configs clip at 0.5
