# RetinaNet ViL-LS-S, COCO 1x.
# Paper numbers: none (the Transformer-LS paper reports no dense prediction: its Sec. 5 leaves it to future work).
_base_ = ['./_base_/retinanet_1x.py', './_base_/vil.py']
model = dict(
    backbone=dict(
        _base_.vil_ls_backbone,
        arch='small',
        drop_path_rate=0.2,
        out_indices=(1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vil_ls_small.pth'),
    ),
    neck=dict(in_channels=[192, 384, 768]),
)
optim_wrapper = dict(clip_grad=dict(max_norm=1.0, norm_type=2))  # paper Table 10: clip at global norm 1
