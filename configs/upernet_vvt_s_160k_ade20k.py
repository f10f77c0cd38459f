# UperNet VVT-Small, ADE20K 160k, 512x512.
# Paper numbers (VVT paper, Table 5, UperNet / Swin setting): 55.5M params, 240 GFLOPs, 46.8 mIoU
# (single scale). The paper publishes no segmentation code or drop-path value; 0.2 is our choice.
_base_ = ['./_base_/upernet_160k_ade20k.py']

model = dict(
    backbone=dict(
        _delete_=True,
        type='VVT',
        arch='small',
        drop_path_rate=0.2,
        out_indices=(0, 1, 2, 3),
        frozen_stages=-1,
        with_cp=False),
        # ImageNet weights (official VVT release, `model` container, loads as is):
        # init_cfg=dict(type='Pretrained', checkpoint='checkpoints/vvt_small.pth')
    decode_head=dict(in_channels=[96, 160, 320, 512]),
    auxiliary_head=dict(in_channels=320))
