"""Running the repository's tools in tests: tiny detection and segmentation configs (a Mask R-CNN and
a UperNet on a ResNet-18 with 16 base channels, on the toy datasets), and the subprocess helpers the
end-to-end tests share."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from paths import ROOT

TOOLS = ROOT / 'tools'

DET_CONFIG = '''
_base_ = ['mmdet::_base_/models/mask-rcnn_r50_fpn.py',
          'mmdet::_base_/default_runtime.py']
data_root = '{data_root}/'
classes = {classes!r}
model = dict(
    backbone=dict(depth=18, base_channels=16, frozen_stages=-1, norm_eval=False,
                  init_cfg=None),
    neck=dict(in_channels=[16, 32, 64, 128], out_channels=32),
    rpn_head=dict(in_channels=32, feat_channels=32),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=32),
        bbox_head=dict(in_channels=32, fc_out_channels=64, num_classes=3),
        mask_roi_extractor=dict(out_channels=32),
        mask_head=dict(num_convs=1, in_channels=32, conv_out_channels=32,
                       num_classes=3)),
    train_cfg=dict(rpn_proposal=dict(nms_pre=200, max_per_img=100),
                   rcnn=dict(sampler=dict(num=64))),
    # score_thr=0 keeps detections from an untrained model, so COCO metrics exist.
    test_cfg=dict(rpn=dict(nms_pre=200, max_per_img=100),
                  rcnn=dict(score_thr=0.0, max_per_img=20)))
train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(160, 128), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(160, 128), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=True),
    dataset=dict(type='CocoDataset', data_root=data_root, metainfo=dict(classes=classes),
                 ann_file='annotations/instances_train.json',
                 data_prefix=dict(img='train/'), pipeline=train_pipeline))
val_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False, drop_last=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(type='CocoDataset', data_root=data_root, metainfo=dict(classes=classes),
                 ann_file='annotations/instances_val.json',
                 data_prefix=dict(img='val/'), test_mode=True, pipeline=test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(type='CocoMetric', ann_file=data_root + 'annotations/instances_val.json',
                     metric=['bbox', 'segm'])
test_evaluator = val_evaluator
train_cfg = dict(type='IterBasedTrainLoop', max_iters=4, val_interval=4)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
optim_wrapper = dict(type='OptimWrapper', clip_grad=dict(max_norm=10.),
                     optimizer=dict(type='SGD', lr=0.005, momentum=0.9, weight_decay=1e-4))
param_scheduler = []
default_hooks = dict(logger=dict(type='LoggerHook', interval=1),
                     checkpoint=dict(type='CheckpointHook', interval=2, by_epoch=False))
log_processor = dict(by_epoch=False)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
auto_scale_lr = dict(enable=False, base_batch_size=2)
randomness = dict(seed=0)
'''

SEG_CONFIG = '''
_base_ = ['mmseg::_base_/default_runtime.py']
data_root = '{data_root}'
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    type='EncoderDecoder',
    data_preprocessor=dict(type='SegDataPreProcessor', mean=[123.675, 116.28, 103.53],
                           std=[58.395, 57.12, 57.375], bgr_to_rgb=True, pad_val=0,
                           seg_pad_val=255, size=(128, 128)),
    backbone=dict(type='ResNetV1c', depth=18, stem_channels=16, base_channels=16,
                  out_indices=(0, 1, 2, 3), norm_cfg=norm_cfg, norm_eval=False),
    decode_head=dict(type='UPerHead', in_channels=[16, 32, 64, 128], in_index=[0, 1, 2, 3],
                     pool_scales=(1, 2, 3, 6), channels=32, dropout_ratio=0.1,
                     num_classes={num_classes}, norm_cfg=norm_cfg, align_corners=False,
                     loss_decode=dict(type='CrossEntropyLoss', loss_weight=1.0)),
    train_cfg=dict(),
    test_cfg=dict(mode='whole'))
metainfo = dict(classes={classes!r})
dataset = dict(type='BaseSegDataset', data_root=data_root, metainfo=metainfo,
               img_suffix='.jpg', seg_map_suffix='.png', reduce_zero_label=True)
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(**dataset, data_prefix=dict(img_path='images/training',
                                              seg_map_path='annotations/training'),
                 pipeline=[dict(type='LoadImageFromFile'), dict(type='LoadAnnotations'),
                           dict(type='RandomFlip', prob=0.5), dict(type='PackSegInputs')]))
val_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=False),
    dataset=dict(**dataset, data_prefix=dict(img_path='images/validation',
                                              seg_map_path='annotations/validation'),
                 pipeline=[dict(type='LoadImageFromFile'), dict(type='LoadAnnotations'),
                           dict(type='PackSegInputs')]))
test_dataloader = val_dataloader
val_evaluator = dict(type='IoUMetric', iou_metrics=['mIoU'])
test_evaluator = val_evaluator
train_cfg = dict(type='IterBasedTrainLoop', max_iters=4, val_interval=4)
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
optim_wrapper = dict(type='OptimWrapper',
                     optimizer=dict(type='SGD', lr=0.01, momentum=0.9, weight_decay=5e-4))
param_scheduler = []
default_hooks = dict(
    timer=dict(type='IterTimerHook'),
    logger=dict(type='LoggerHook', interval=1, log_metric_by_epoch=False),
    param_scheduler=dict(type='ParamSchedulerHook'),
    checkpoint=dict(type='CheckpointHook', by_epoch=False, interval=4),
    sampler_seed=dict(type='DistSamplerSeedHook'),
    visualization=dict(type='SegVisualizationHook'))
log_processor = dict(by_epoch=False)
env_cfg = dict(dist_cfg=dict(backend='gloo'))
randomness = dict(seed=0)
'''


def _run(args: list[str], cwd: Path, timeout: int = 240, env: dict | None = None):
    """Run a command; fail the test with its output if it exits non-zero."""
    proc = subprocess.run(
        args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )
    if proc.returncode != 0:
        pytest.fail(
            f'{args} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}'
        )
    return proc


def _tool(name: str, *args) -> list[str]:
    return [sys.executable, str(TOOLS / name), *map(str, args)]


def _log_text(work_dir: Path) -> str:
    """Concatenated text of all run logs under work_dir (one per timestamp)."""
    return '\n'.join(p.read_text() for p in sorted(work_dir.glob('*/*.log')))


def _test_metrics(work_dir: Path) -> dict:
    """The metrics json LoggerHook writes after a test run."""
    (path,) = [p for p in work_dir.glob('*/*.json') if p.parent.name == p.stem]
    return json.loads(path.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _load_tool(name: str):
    """Import ``tools/<name>.py`` (``name`` such as ``'train'`` or ``'analysis/benchmark'``) by its path, under a
    private module name (registered in ``sys.modules``, where dataclasses look their module up): the tools are
    scripts, not modules on ``sys.path``. Each call runs the file afresh."""
    module_name = '_visattn_tool_' + name.replace('/', '_')
    spec = importlib.util.spec_from_file_location(module_name, TOOLS / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module
