# Mask R-CNN + FPN on COCO (bbox + segm evaluation), 3x + multi-scale (./det_schedule_3x_ms.py).
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    './det_schedule_3x_ms.py',
]
train_pipeline = [_base_.multiscale_resize if step.type == 'Resize' else step for step in _base_.train_pipeline]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
