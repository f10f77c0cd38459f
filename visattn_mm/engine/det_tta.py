"""Test-time augmentation for Mask R-CNN that keeps the masks.

mmdet 3.3's ``DetTTAModel`` refuses predictions with masks, so a Mask R-CNN
config could not be tested with ``--tta``. :class:`InstanceAwareDetTTAModel`
merges boxes exactly as ``DetTTAModel`` does (boxes flipped back, NMS over all
views) and keeps the masks of the surviving boxes; masks are predicted at the
original image size, so undoing the flip is all they need.

Needs mmdet and mmcv's compiled ops; ``visattn_mm.registry`` registers the class
where they import, so a config names it as
``tta_model = dict(type='InstanceAwareDetTTAModel', tta_cfg=...)``.
"""

import torch
from mmcv.ops import batched_nms
from mmdet.models import DetTTAModel
from mmengine.structures import InstanceData

_FLIP_DIMS = {'horizontal': (-1,), 'vertical': (-2,), 'diagonal': (-2, -1)}


def unflip_masks(masks, flip, direction):
    """Flip masks predicted on a flipped view back onto the original image."""
    return masks.flip(_FLIP_DIMS[direction]) if flip else masks


class InstanceAwareDetTTAModel(DetTTAModel):
    """``DetTTAModel`` that also merges instance masks (see the module docstring)."""

    def _merge_single_sample(self, data_samples):
        if data_samples[0].pred_instances.get('masks', None) is None:
            return super()._merge_single_sample(data_samples)
        preds = [s.pred_instances for s in data_samples]
        metas = [s.metainfo for s in data_samples]
        boxes, scores = self.merge_aug_bboxes([p.bboxes for p in preds], [p.scores for p in preds], metas)
        if boxes.numel() == 0:
            return data_samples[0]
        labels = torch.cat([p.labels for p in preds])
        masks = torch.cat([unflip_masks(p.masks, m['flip'], m['flip_direction']) for p, m in zip(preds, metas)])
        dets, keep = batched_nms(boxes, scores, labels, self.tta_cfg['nms'])
        keep = keep[: self.tta_cfg['max_per_img']]
        merged = data_samples[0]
        merged.pred_instances = InstanceData(
            bboxes=dets[: len(keep), :-1], scores=dets[: len(keep), -1], labels=labels[keep], masks=masks[keep]
        )
        return merged
