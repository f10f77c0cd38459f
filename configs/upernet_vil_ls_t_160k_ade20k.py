# UperNet ViL-LS-T, ADE20K 160k, 512x512.
# Paper numbers: none (the Transformer-LS paper reports no dense prediction: its Sec. 5 leaves it to future work).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vil.py']
model = dict(
    backbone=dict(
        _base_.vil_ls_backbone,
        arch='tiny',
        drop_path_rate=0.1,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vil_ls_tiny.pth'),
    ),
    decode_head=dict(in_channels=[48, 96, 192, 384]),
    auxiliary_head=dict(in_channels=192),
)
