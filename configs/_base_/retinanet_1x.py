# RetinaNet + FPN (./retinanet_fpn.py) on COCO, 1x (./det_schedule_1x.py).
_base_ = ['./retinanet_fpn.py', 'mmdet::_base_/datasets/coco_detection.py', './det_schedule_1x.py']
