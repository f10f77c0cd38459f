# Mask R-CNN Pale-B, COCO 3x+MS.
# Paper numbers: none (the Pale paper reports Mask R-CNN 1x only).
_base_ = ['./_base_/maskrcnn_3x_ms.py', './_base_/pale.py']
model = dict(
    backbone=dict(
        _base_.pale_backbone,
        arch='base',
        drop_path_rate=0.5,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/pale_base.pth'),
    ),
    neck=dict(in_channels=[128, 256, 512, 1024]),
)
optim_wrapper = dict(optimizer=dict(weight_decay=0.05))  # paper: 0.001 (T, S) / 0.05 (B)
