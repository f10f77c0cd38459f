# Mask R-CNN + FPN with a ViL backbone, COCO 1x (12 epochs, steps at 8 and 11).
# Recipe: ../shared/SPEC.md 1.6 (official ViL detection code) and mmdet's Swin configs.
_base_ = ['./maskrcnn_1x.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='ViL',
        arch='small',
        window_size=7,
        masking_mode=0,        # "sliding chunk without padding", the detection default
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        frozen_stages=-1,
        with_cp=False),
    neck=dict(in_channels=[96, 192, 384, 768]))

# No decay for RPB tables and global tokens either (norms: see the base).
optim_wrapper = dict(
    # The official detectron2 Mask R-CNN configs clip the global grad norm at 0.5.
    clip_grad=dict(max_norm=0.5, norm_type=2),
    paramwise_cfg=dict(
        custom_keys={
            'relative_position': dict(decay_mult=0.0),
            'cls_token': dict(decay_mult=0.0),
            'pos_embed': dict(decay_mult=0.0),
        }))
