# UperNet Pale-B, ADE20K 160k, 512x512.
# Paper numbers (Pale, Table 4): 119M params, 52.2 / 53.0 mIoU (single / multi scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/pale.py']
model = dict(
    backbone=_base_.sizes.b.backbone,
    decode_head=dict(in_channels=_base_.sizes.b.dims),
    auxiliary_head=dict(in_channels=_base_.sizes.b.dims[2]),
)
