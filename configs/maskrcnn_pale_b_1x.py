# Mask R-CNN Pale-B, COCO 1x.
# Paper numbers (Pale, Table 3): 105M params, 49.3 / 44.2 box / mask AP.
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/pale.py']
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
