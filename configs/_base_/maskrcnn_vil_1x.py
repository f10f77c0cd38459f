# Mask R-CNN + FPN with a ViL backbone, COCO 1x (12 epochs, steps at 8 and 11).
# Recipe: ../shared/SPEC.md 1.6 (official ViL detection code) and mmdet's Swin configs.
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
        type='ViL',
        arch='small',
        window_size=7,
        masking_mode=0,        # "sliding chunk without padding", the detection default
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        frozen_stages=-1,
        with_cp=False),
    neck=dict(in_channels=[96, 192, 384, 768]))

# AdamW, lr 1e-4, wd 0.05; no decay for norms (by type), RPB tables and global tokens.
optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(_delete_=True, type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    # The official detectron2 Mask R-CNN configs clip the global grad norm at 0.5.
    clip_grad=dict(max_norm=0.5, norm_type=2),
    paramwise_cfg=dict(
        norm_decay_mult=0.0,
        custom_keys={
            'relative_position': dict(decay_mult=0.0),
            'cls_token': dict(decay_mult=0.0),
            'pos_embed': dict(decay_mult=0.0),
        }))

param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=12, by_epoch=True, milestones=[8, 11], gamma=0.1),
]

# Learning rates above are for 16 images per step (8 GPUs x 2), as in the paper.
auto_scale_lr = dict(enable=False, base_batch_size=16)
