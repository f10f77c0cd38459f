# UperNet VVT-S, ADE20K 160k, 512x512.
# Paper numbers (VVT, Table 5): 55.5M params, 46.8 mIoU (single scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vvt.py']
model = dict(
    backbone=dict(
        _base_.vvt_backbone,
        arch='small',
        drop_path_rate=0.2,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vvt_small.pth'),
    ),
    decode_head=dict(in_channels=[96, 160, 320, 512]),
    auxiliary_head=dict(in_channels=320),
)
