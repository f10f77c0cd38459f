# RetinaNet ViL-LS-M, COCO 1x.
# Paper numbers: none (the Transformer-LS paper reports no dense prediction: its Sec. 5 leaves it to future work).
_base_ = ['./_base_/retinanet_1x.py', './_base_/vil.py']
model = dict(
    backbone=dict(_base_.ls_sizes.m.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.ls_sizes.m.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.m
