# UperNet VVT-S, ADE20K 160k, 512x512.
# Paper numbers (VVT, Table 5): 55.5M params, 46.8 mIoU (single scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vvt.py']
model = dict(
    backbone=_base_.sizes.s.backbone,
    decode_head=dict(in_channels=_base_.sizes.s.dims),
    auxiliary_head=dict(in_channels=_base_.sizes.s.dims[2]),
)
