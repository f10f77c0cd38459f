# Mask R-CNN + FPN on COCO (bbox + segm evaluation), 1x (./det_schedule_1x.py).
# Final configs replace the backbone (a family base's dict, `_delete_=True`) and the neck's
# input channels (the backbone's four stage dims).
_base_ = [
    'mmdet::_base_/models/mask-rcnn_r50_fpn.py',
    'mmdet::_base_/datasets/coco_instance.py',
    './det_schedule_1x.py',
]
