# COCO 1x for the detectors: 12 epochs, steps at 8 and 11, with the papers' optimiser (AdamW,
# lr 1e-4, weight decay 0.05, no decay per ./optim_no_decay.py) and a 1000-iteration linear
# warm-up (mmdet's Swin setting). Final configs add what their paper specifies on top
# (gradient clipping, another weight decay). tools/train.py --amp swaps the wrapper type.
_base_ = [
    'mmdet::_base_/schedules/schedule_1x.py',
    'mmdet::_base_/default_runtime.py',
    './optim_no_decay.py',
]
custom_imports = dict(imports=['visattn_mm'], allow_failed_imports=False)
# load_from, tools/test.py's checkpoint and --resume load under the plugin's checkpoint
# policy (load report, refusal below 90%), also from mmdet's/mmseg's own tools and mim.
runner_type = 'CheckpointPolicyRunner'
# Random-number states go into every checkpoint, so --resume continues exactly
# (configs that use RandomShiftHook replace this list; that hook saves them too).
custom_hooks = [dict(type='RngStateHook')]

optim_wrapper = dict(
    type='OptimWrapper',
    optimizer=dict(_delete_=True, type='AdamW', lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    paramwise_cfg=_base_.no_decay_paramwise_cfg,
    constructor=_base_.optim_wrapper_constructor,
)

param_scheduler = [
    dict(type='LinearLR', start_factor=0.001, by_epoch=False, begin=0, end=1000),
    dict(type='MultiStepLR', begin=0, end=12, by_epoch=True, milestones=[8, 11], gamma=0.1),
]

# Learning rates above are for 16 images per step (8 GPUs x 2), as in the papers.
auto_scale_lr = dict(enable=False, base_batch_size=16)
