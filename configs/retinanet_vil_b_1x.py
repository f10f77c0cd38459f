# RetinaNet ViL-B, COCO 1x.
# Paper numbers (ViL, Table 6; ImageNet-21k pretraining): 66.74M params, 47.8 AP.
_base_ = ['./_base_/retinanet_1x.py', './_base_/vil.py']
model = dict(
    backbone=dict(_base_.sizes.b.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.b.dims[1:])
)
# Base: lr 8e-5 (ViL paper Table 10); paper Table 10: clip at global norm 1.
optim_wrapper = dict(optimizer=dict(lr=8e-5), clip_grad=dict(max_norm=1.0, norm_type=2))
