# RetinaNet ViL-S, COCO 1x.
# Paper numbers (ViL, Table 6): 35.68M params, 44.2 AP.
_base_ = ['./_base_/retinanet_1x.py', './_base_/vil.py']
model = dict(
    backbone=dict(_base_.sizes.s.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.sizes.s.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.s
