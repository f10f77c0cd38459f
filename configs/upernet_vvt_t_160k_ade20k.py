# UperNet VVT-T, ADE20K 160k, 512x512.
# Paper numbers: none (the VVT paper reports no UperNet VVT-T).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vvt.py']
model = dict(
    backbone=dict(
        _base_.vvt_backbone,
        arch='tiny',
        drop_path_rate=0.1,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vvt_tiny.pth'),
    ),
    decode_head=dict(in_channels=[96, 160, 320, 512]),
    auxiliary_head=dict(in_channels=320),
)
