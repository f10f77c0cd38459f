# Mask R-CNN ViL-LS-T, COCO 3x+MS.
# Paper numbers: none (the Transformer-LS paper reports no dense prediction: its Sec. 5 leaves it to future work).
_base_ = ['./_base_/maskrcnn_3x_ms.py', './_base_/vil.py']
model = dict(backbone=_base_.ls_sizes.t.backbone, neck=dict(in_channels=_base_.ls_sizes.t.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.t
