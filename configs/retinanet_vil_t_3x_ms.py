# RetinaNet ViL-T, COCO 3x+MS.
# Paper numbers (ViL, Table 6): 16.64M params, 43.6 AP.
_base_ = ['./_base_/retinanet_3x_ms.py', './_base_/vil.py']
model = dict(
    backbone=dict(
        _base_.vil_backbone,
        arch='tiny',
        drop_path_rate=0.1,
        out_indices=(1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vil_tiny.pth'),
    ),
    neck=dict(in_channels=[96, 192, 384]),
)
optim_wrapper = dict(clip_grad=dict(max_norm=1.0, norm_type=2))  # paper Table 10: clip at global norm 1
