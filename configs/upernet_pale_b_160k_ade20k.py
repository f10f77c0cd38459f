# UperNet Pale-B, ADE20K 160k, 512x512.
# Paper numbers (Pale, Table 4): 119M params, 52.2 / 53.0 mIoU (single / multi scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/pale.py']
model = dict(
    backbone=dict(
        _base_.pale_backbone,
        arch='base',
        drop_path_rate=0.5,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/pale_base.pth'),
    ),
    decode_head=dict(in_channels=[128, 256, 512, 1024]),
    auxiliary_head=dict(in_channels=512),
)
