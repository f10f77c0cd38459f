# UperNet VVT-T, ADE20K 160k, 512x512.
# Paper numbers: none (the VVT paper reports no UperNet VVT-T).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vvt.py']
model = dict(
    backbone=_base_.sizes.t.backbone,
    decode_head=dict(in_channels=_base_.sizes.t.dims),
    auxiliary_head=dict(in_channels=_base_.sizes.t.dims[2]),
)
