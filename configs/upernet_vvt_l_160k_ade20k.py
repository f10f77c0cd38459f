# UperNet VVT-L, ADE20K 160k, 512x512.
# Paper numbers (VVT, Table 5): 91.9M params, 48.8 mIoU (single scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vvt.py']
model = dict(
    backbone=_base_.sizes.l.backbone,
    decode_head=dict(in_channels=_base_.sizes.l.dims),
    auxiliary_head=dict(in_channels=_base_.sizes.l.dims[2]),
)
