# Mask R-CNN + FPN with a VVT-Small backbone, COCO 1x (12 epochs, steps at 8 and 11).
# The VVT paper reports no detection results and publishes no detection recipe: this is
# the plugin's Mask R-CNN 1x recipe (mmdet's Swin settings: AdamW lr 1e-4, wd 0.05, no decay
# on norms, 1000-iteration warm-up). Gradient clipping at 1.0 and drop path 0.2 are our choices.
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['visattn_mm'], allow_failed_imports=False)

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

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(_delete_=True, type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    clip_grad=dict(max_norm=1.0, norm_type=2),
    paramwise_cfg=dict(norm_decay_mult=0.0))

param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=12, by_epoch=True, milestones=[8, 11], gamma=0.1),
]

# Learning rates above are for 16 images per step (8 GPUs x 2).
auto_scale_lr = dict(enable=False, base_batch_size=16)
