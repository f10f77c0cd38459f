# Mask R-CNN ViL-LS-S, COCO 1x.
# Paper numbers: none (the Transformer-LS paper reports no dense prediction: its Sec. 5 leaves it to future work).
_base_ = ['./_base_/maskrcnn_1x.py', './_base_/vil.py']
model = dict(
    backbone=dict(
        _base_.vil_ls_backbone,
        arch='small',
        drop_path_rate=0.2,
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vil_ls_small.pth'),
    ),
    neck=dict(in_channels=[96, 192, 384, 768]),
)
optim_wrapper = dict(clip_grad=dict(max_norm=0.5, norm_type=2))  # official detectron2 Mask R-CNN configs clip at 0.5
