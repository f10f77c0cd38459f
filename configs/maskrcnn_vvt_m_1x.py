# Mask R-CNN VVT-M, COCO 1x.
# Paper numbers: none (the VVT paper reports no detection results).
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vvt.py']
model = dict(
    backbone=dict(
        _base_.vvt_backbone,
        arch='medium',
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vvt_medium.pth'),
    ),
    neck=dict(in_channels=[96, 160, 320, 512]),
)
optim_wrapper = dict(clip_grad=dict(max_norm=1.0, norm_type=2))  # our choice (no VVT detection recipe)
