# UperNet ViL-LS-S, ADE20K 160k, 512x512.
# Paper numbers: none (the Transformer-LS paper reports no dense prediction: its Sec. 5 leaves it to future work).
_base_ = ['./_base_/upernet_160k_ade20k.py', './_base_/vil.py']
model = dict(
    backbone=_base_.ls_sizes.s.backbone,
    decode_head=dict(in_channels=_base_.ls_sizes.s.dims),
    auxiliary_head=dict(in_channels=_base_.ls_sizes.s.dims[2]),
)
