# UperNet Pale-T, ADE20K 160k, 512x512.
# Paper (Pale Transformer, Table 4 and appendix): 52M params, 996 GFLOPs at 512x2048,
# 50.4 / 51.2 mIoU (single / multi scale); Swin's UperNet setting (AdamW lr 6e-5, wd 0.01,
# 1500 warm-up iterations then poly decay, batch 16, auxiliary head on stage 3 with weight 0.4,
# all in the shared base) and drop path 0.3 (T) / 0.3 (S) / 0.5 (B).
_base_ = ['./_base_/upernet_160k_ade20k.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='PaleTransformer',
        arch='tiny',
        drop_path_rate=0.3,
        out_indices=(0, 1, 2, 3),
        frozen_stages=-1,
        norm_eval=False,
        with_cp=False),
        # ImageNet weights (a Classifier(backbone_type="PaleTransformer") / timm-format checkpoint of your own):
        # init_cfg=dict(type='Pretrained', checkpoint='checkpoints/pale_tiny.pth')
    decode_head=dict(in_channels=[64, 128, 256, 512]),
    auxiliary_head=dict(in_channels=256))
