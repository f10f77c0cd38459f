# Mask R-CNN + FPN, COCO 1x (12 epochs, steps at 8 and 11), with the plugin's optimiser recipe
# (mmdet's Swin settings): AdamW lr 1e-4, wd 0.05, no decay on norms (by type), 1000-iteration
# linear warm-up. Derived configs replace the backbone (`_delete_=True`) and the neck's input
# channels, and add what their paper specifies (gradient clipping, weight decay, ...).
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
]
custom_imports = dict(imports=['visattn_mm'], allow_failed_imports=False)

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(_delete_=True, type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=dict(norm_decay_mult=0.0))

param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=12, by_epoch=True, milestones=[8, 11], gamma=0.1),
]

# Learning rates above are for 16 images per step (8 GPUs x 2), as in the papers.
auto_scale_lr = dict(enable=False, base_batch_size=16)
