# Mask R-CNN ViL-LS-S, COCO 3x+MS.
# Paper numbers: none (the Transformer-LS paper reports no dense prediction: its Sec. 5 leaves it to future work).
_base_ = ['./_base_/maskrcnn_3x_ms.py', './_base_/vil.py']
model = dict(backbone=_base_.ls_sizes.s.backbone, neck=dict(in_channels=_base_.ls_sizes.s.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.s
