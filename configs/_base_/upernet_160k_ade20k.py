# UperNet on ADE20K, 160k iterations, 512x512 crops: the shared segmentation recipe
# (mmseg's Swin UperNet setting, which the VVT and Pale papers follow).
# Final configs replace the backbone (a family base's dict, `_delete_=True`) and the heads'
# input channels:
#   model = dict(backbone=dict(_base_.<family>_backbone, arch=..., ...),
#                decode_head=dict(in_channels=[c1, c2, c3, c4]),
#                auxiliary_head=dict(in_channels=c3))
_base_ = [
    'mmseg::_base_/models/upernet_r50.py',
    'mmseg::_base_/datasets/ade20k.py',
    'mmseg::_base_/default_runtime.py',
    'mmseg::_base_/schedules/schedule_160k.py',
    './optim_no_decay.py',
]
custom_imports = dict(imports=['visattn_mm'], allow_failed_imports=False)
# load_from, tools/test.py's checkpoint and --resume load under the plugin's checkpoint
# policy (load report, refusal below 90%), also from mmdet's/mmseg's own tools and mim.
runner_type = 'CheckpointPolicyRunner'
# Random-number states go into every checkpoint, so --resume continues exactly
# (configs that use RandomShiftHook replace this list; that hook saves them too).
custom_hooks = [dict(type='RngStateHook')]

crop_size = (512, 512)
# Plain BN instead of mmseg's SyncBN, so single-process (CPU, one GPU) runs work too.
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    pretrained=None,
    data_preprocessor=dict(
        size=crop_size,
        # mmseg does not pad test images by default; backbones would see e.g. 512x683.
        test_cfg=dict(size_divisor=32),
    ),
    backbone=dict(norm_cfg=norm_cfg),  # placeholder (ResNet-50) until a derived config replaces it
    decode_head=dict(num_classes=150, norm_cfg=norm_cfg),
    # Auxiliary FCN head on the stage-3 output (in_index=2), loss weight 0.4.
    auxiliary_head=dict(
        in_index=2,
        num_classes=150,
        norm_cfg=norm_cfg,
        loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=0.4),
    ),
)

# AdamW lr 6e-5, weight decay 0.01; no decay per ./optim_no_decay.py.
optim_wrapper = dict(
    _delete_=True,
    type='OptimWrapper',
    optimizer=dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01),
    paramwise_cfg=_base_.no_decay_paramwise_cfg,
    constructor=_base_.optim_wrapper_constructor,
)

# Linear warm-up over 1500 iterations, then poly decay (power 1.0) to 0 at 160k.
param_scheduler = [
    dict(type='LinearLR', start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type='PolyLR', eta_min=0.0, power=1.0, begin=1500, end=160000, by_epoch=False),
]

# 16 images per step as in the papers: 8 GPUs x 2 images.
train_dataloader = dict(batch_size=2)
val_dataloader = dict(batch_size=1)
test_dataloader = val_dataloader
auto_scale_lr = dict(enable=False, base_batch_size=16)
