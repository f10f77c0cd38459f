# RetinaNet ViL-S, COCO 3x+MS.
# Paper numbers (ViL, Table 6): 35.68M params, 45.9 AP.
_base_ = ['./_base_/retinanet_3x_ms.py', './_base_/vil.py']
model = dict(
    backbone=dict(_base_.sizes.s.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.s.dims[1:])
)
optim_wrapper = dict(clip_grad=dict(max_norm=1.0, norm_type=2))  # paper Table 10: clip at global norm 1
