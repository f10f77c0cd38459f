# Mask R-CNN + FPN with a VVT-Small backbone, COCO 1x (12 epochs, steps at 8 and 11).
# The VVT paper reports no detection results and publishes no detection recipe: this is
# the plugin's Mask R-CNN 1x recipe (mmdet's Swin settings: AdamW lr 1e-4, wd 0.05, no decay
# on norms, 1000-iteration warm-up). Gradient clipping at 1.0 and drop path 0.2 are our choices.
_base_ = ['./_base_/maskrcnn_1x.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='VVT',
        arch='small',
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        frozen_stages=-1,
        with_cp=False),
        # ImageNet weights (official VVT release, `model` container, loads as is):
        # init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vvt_small.pth')
    neck=dict(in_channels=[96, 160, 320, 512]))

optim_wrapper = dict(clip_grad=dict(max_norm=1.0, norm_type=2))
