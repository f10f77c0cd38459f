# UperNet VVT-M, ADE20K 160k, 512x512.
# Paper numbers (VVT, Table 5): 77.9M params, 48.1 mIoU (single scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vvt.py']
model = dict(
    backbone=_base_.sizes.m.backbone,
    decode_head=dict(in_channels=_base_.sizes.m.dims),
    auxiliary_head=dict(in_channels=_base_.sizes.m.dims[2]),
)
