# RetinaNet Pale-S, COCO 1x.
# Paper numbers: none (the Pale paper reports Mask R-CNN 1x only).
_base_ = ['./_base_/retinanet_1x.py', './_base_/pale.py']
model = dict(
    backbone=dict(_base_.sizes.s.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.s.dims[1:])
)
optim_wrapper = dict(optimizer=dict(weight_decay=0.001))  # paper: 0.001 (T, S) / 0.05 (B)
