# RetinaNet ViL-S, COCO 3x+MS.
# Paper numbers (ViL, Table 6): 35.68M params, 45.9 AP.
_base_ = ['./_base_/retinanet_3x_ms.py', './_base_/vil.py']
model = dict(
    backbone=dict(_base_.sizes.s.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.s.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.s
