# Mask R-CNN + FPN with a Pale-T backbone, COCO 1x (12 epochs, steps at 8 and 11).
# Paper (Pale Transformer, Table 3 and appendix): 41M params, 306 GFLOPs at 1280x800,
# 47.4 box AP / 42.7 mask AP; AdamW lr 1e-4, weight decay 0.001 (Pale-T/S; 0.05 for Pale-B),
# drop path 0.2 (T) / 0.3 (S) / 0.5 (B), batch 16, single scale (800, 1333), following CSWin.
# Not stated in the paper, our choices: 1000-iteration linear warm-up and no weight decay on
# norms (mmdet's Swin settings), no gradient clipping (CSWin/Swin Mask R-CNN 1x configs).
# No official Pale weights exist: train a Pale classifier first (e.g. through timm) and load it
# with init_cfg; the classification head and missing output norms are reported.
_base_ = ['./_base_/maskrcnn_1x.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='PaleTransformer',
        arch='tiny',
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        frozen_stages=-1,
        norm_eval=False,
        with_cp=False),
        # ImageNet weights (a Classifier(backbone_type="PaleTransformer") / timm-format checkpoint of your own):
        # init_cfg=dict(type='Pretrained', checkpoint='checkpoints/pale_tiny.pth')
    neck=dict(in_channels=[64, 128, 256, 512]))

optim_wrapper = dict(optimizer=dict(weight_decay=0.001))
