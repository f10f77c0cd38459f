# UperNet Pale-S, ADE20K 160k, 512x512.
# Paper numbers (Pale, Table 4): 80M params, 51.2 / 52.2 mIoU (single / multi scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/pale.py']
model = dict(
    backbone=dict(
        _base_.pale_backbone,
        arch='small',
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/pale_small.pth'),
    ),
    decode_head=dict(in_channels=[96, 192, 384, 768]),
    auxiliary_head=dict(in_channels=384),
)
