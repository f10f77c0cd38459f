# Mask R-CNN ViL-LS-B, COCO 1x.
# Paper numbers: none (the Transformer-LS paper reports no dense prediction: its Sec. 5 leaves it to future work).
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vil.py']
model = dict(
    backbone=dict(
        _base_.vil_ls_backbone,
        arch='base',
        drop_path_rate=0.3,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vil_ls_base.pth'),
    ),
    neck=dict(in_channels=[96, 192, 384, 768]),
)
# Base: lr 8e-5 (ViL paper Table 10); official detectron2 Mask R-CNN configs clip at 0.5.
optim_wrapper = dict(optimizer=dict(lr=8e-5), clip_grad=dict(max_norm=0.5, norm_type=2))
