# RetinaNet ViL-M, COCO 3x+MS.
# Paper numbers (ViL, Table 6; ImageNet-21k pretraining): 50.77M params, 47.9 AP.
_base_ = ['./_base_/retinanet_3x_ms.py', './_base_/vil.py']
model = dict(
    backbone=dict(
        _base_.vil_backbone,
        arch='medium',
        drop_path_rate=0.3,
        out_indices=(1, 2, 3),
        init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vil_medium.pth'),
    ),
    neck=dict(in_channels=[192, 384, 768]),
)
optim_wrapper = dict(clip_grad=dict(max_norm=1.0, norm_type=2))  # paper Table 10: clip at global norm 1
