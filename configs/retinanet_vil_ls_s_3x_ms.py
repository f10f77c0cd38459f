# RetinaNet ViL-LS-S, COCO 3x+MS.
# Paper numbers: none (the Transformer-LS paper reports no dense prediction: its Sec. 5 leaves it to future work).
_base_ = ['./_base_/retinanet_3x_ms.py', './_base_/vil.py']
model = dict(
    backbone=dict(_base_.ls_sizes.s.backbone, out_indices=(1, 2, 3)), neck=dict(in_channels=_base_.ls_sizes.s.dims[1:])
)
optim_wrapper = _base_.det_optim_wrapper.retinanet.s
