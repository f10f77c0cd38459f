# UperNet ViL-B, ADE20K 160k, 512x512.
# Paper numbers: none (the ViL paper reports no segmentation results).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vil.py']
model = dict(
    backbone=dict(
        _base_.vil_backbone,
        arch='base',
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vil_base.pth'),
    ),
    decode_head=dict(in_channels=[96, 192, 384, 768]),
    auxiliary_head=dict(in_channels=384),
)
