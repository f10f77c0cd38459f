# UperNet Pale-T, ADE20K 160k, 512x512.
# Paper numbers (Pale, Table 4): 52M params, 50.4 / 51.2 mIoU (single / multi scale).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/pale.py']
# Segmentation: drop path 0.3 for Pale-T too (Pale paper, appendix).
model = dict(
    backbone=dict(_base_.sizes.t.backbone, drop_path_rate=0.3),
    decode_head=dict(in_channels=_base_.sizes.t.dims),
    auxiliary_head=dict(in_channels=_base_.sizes.t.dims[2]),
)
