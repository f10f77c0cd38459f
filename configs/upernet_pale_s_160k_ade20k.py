# UperNet Pale-S, ADE20K 160k, 512x512.
# Paper numbers (Pale, Table 4): 80M params, 51.2 / 52.2 mIoU (single / multi scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/pale.py']
model = dict(
    backbone=_base_.sizes.s.backbone,
    decode_head=dict(in_channels=_base_.sizes.s.dims),
    auxiliary_head=dict(in_channels=_base_.sizes.s.dims[2]),
)
