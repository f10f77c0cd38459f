# UperNet ViL-S, ADE20K 160k, 512x512.
# Paper numbers: none (the ViL paper reports no segmentation results).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vil.py']
model = dict(
    backbone=_base_.sizes.s.backbone,
    decode_head=dict(in_channels=_base_.sizes.s.dims),
    auxiliary_head=dict(in_channels=_base_.sizes.s.dims[2]),
)
