# The demo: Mask R-CNN ViL-T trained from scratch on the generated toy COCO dataset
# (tools/make_toy_data.py: 3 classes of simple shapes, 160x128 images) on a CPU.
# Run it with `bash tools/demo.sh`; the paper settings live in ../maskrcnn_vil_t_1x.py.
_base_ = ['../maskrcnn_vil_t_1x.py']

data_root = 'data/toy_coco/'
classes = ('circle', 'square', 'triangle')
metainfo = dict(classes=classes, palette=[(220, 20, 60), (0, 128, 255), (0, 200, 0)])
image_scale = (160, 128)
max_iters = 150

model = dict(
    # Small data from scratch (no ImageNet weights): no stochastic depth; random-shift training
    # (RandomShiftHook below).
    backbone=dict(drop_path_rate=0.0, init_cfg=None),
    roi_head=dict(bbox_head=dict(num_classes=len(classes)), mask_head=dict(num_classes=len(classes))),
    # At most 4 objects per image: fewer sampled anchors/RoIs keep mmcv's CPU RoIAlign cheap, and
    # fewer proposals and detections the evaluation (the untrained model's 100 detections per image
    # made the mask head's convolutions most of a 5-minute evaluation).
    train_cfg=dict(rpn=dict(sampler=dict(num=128)), rcnn=dict(sampler=dict(num=128))),
    test_cfg=dict(rpn=dict(nms_pre=300, max_per_img=300), rcnn=dict(max_per_img=20)),
)

train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=image_scale, keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=image_scale, keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=4,
    num_workers=1,
    persistent_workers=True,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_train.json',
        data_prefix=dict(img='train/'),
        pipeline=train_pipeline,
    ),
)
val_dataloader = dict(
    batch_size=4,
    num_workers=1,
    persistent_workers=True,
    dataset=dict(
        data_root=data_root,
        metainfo=metainfo,
        ann_file='annotations/instances_val.json',
        data_prefix=dict(img='val/'),
        pipeline=test_pipeline,
    ),
)
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val.json', metric=['bbox', 'segm'])
test_evaluator = val_evaluator

train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=max_iters, val_interval=max_iters)
optim_wrapper = dict(optimizer=dict(lr=4e-4))
param_scheduler = [
    dict(type='LinearLR', start_factor=0.01, by_epoch=False, begin=0, end=50),
    dict(
        type='MultiStepLR',
        by_epoch=False,
        begin=0,
        end=max_iters,
        milestones=[int(max_iters * 0.75), int(max_iters * 0.9)],
        gamma=0.1,
    ),
]
custom_hooks = [dict(type='RandomShiftHook', switch_ratio=0.75)]
default_hooks = dict(logger=dict(interval=5), checkpoint=dict(by_epoch=False, interval=max_iters, max_keep_ckpts=1))
log_processor = dict(by_epoch=False)
