# UperNet VVT-L, ADE20K 160k, 512x512.
# Paper numbers (VVT, Table 5): 91.9M params, 48.8 mIoU (single scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vvt.py']
model = dict(
    backbone=dict(
        _base_.vvt_backbone,
        arch='large',
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vvt_large.pth'),
    ),
    decode_head=dict(in_channels=[96, 160, 320, 512]),
    auxiliary_head=dict(in_channels=320),
)
