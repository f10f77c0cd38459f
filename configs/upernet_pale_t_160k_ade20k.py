# UperNet Pale-T, ADE20K 160k, 512x512.
# Paper numbers (Pale, Table 4): 52M params, 50.4 / 51.2 mIoU (single / multi scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/pale.py']
model = dict(
    backbone=dict(
        _base_.pale_backbone,
        arch='tiny',
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/pale_tiny.pth'),
    ),
    decode_head=dict(in_channels=[64, 128, 256, 512]),
    auxiliary_head=dict(in_channels=256),
)
