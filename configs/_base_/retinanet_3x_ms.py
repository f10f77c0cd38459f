# RetinaNet + FPN (./retinanet_fpn.py) on COCO, 3x + multi-scale (./det_schedule_3x_ms.py).
_base_ = ['./retinanet_fpn.py', 'mmdet::_base_/datasets/coco_detection.py', './det_schedule_3x_ms.py']
train_pipeline = [_base_.multiscale_resize if step.type == 'Resize' else step for step in _base_.train_pipeline]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
