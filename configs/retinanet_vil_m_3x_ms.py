# RetinaNet ViL-M, COCO 3x+MS.
# Paper numbers (ViL, Table 6; ImageNet-21k pretraining): 50.77M params, 47.9 AP.
_base_ = ['./_base_/retinanet_3x_ms.py', './_base_/vil.py']
model = dict(
    backbone=dict(_base_.sizes.m.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.m.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.m
