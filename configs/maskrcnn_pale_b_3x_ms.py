# Mask R-CNN Pale-B, COCO 3x+MS.
# Paper numbers: none (the Pale paper reports Mask R-CNN 1x only).
_base_ = ['./_base_/maskrcnn_3x_ms.py', './_base_/pale.py']
model = dict(backbone=_base_.sizes.b.backbone, neck=dict(in_channels=_base_.sizes.b.dims))
optim_wrapper = _base_.det_optim_wrapper.maskrcnn.b
