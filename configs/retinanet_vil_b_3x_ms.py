# RetinaNet ViL-B, COCO 3x+MS.
# Paper numbers (ViL, Table 6; ImageNet-21k pretraining): 66.74M params, 48.6 AP.
_base_ = ['./_base_/retinanet_3x_ms.py', './_base_/vil.py']
model = dict(
    backbone=dict(_base_.sizes.b.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.b.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.b
