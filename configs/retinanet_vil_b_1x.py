# RetinaNet ViL-B, COCO 1x.
# Paper numbers (ViL, Table 6; ImageNet-21k pretraining): 66.74M params, 47.8 AP.
_base_ = ['./_base_/retinanet_1x.py', './_base_/vil.py']
model = dict(
    backbone=dict(_base_.sizes.b.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.b.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.b
