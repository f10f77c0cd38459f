"""End-to-end tests of tools/train.py, tools/test.py and tools/dist_train.sh.

Every run is a real subprocess with this interpreter, on tiny configs written
here (a Mask R-CNN and a UperNet on a ResNet-18 with 16 base channels) and
the toy datasets from tools/make_toy_data.py, so nothing depends on the
plugin's own backbones. Also covers visattn_mm.compat through a real resume,
test-time augmentation for both tasks, and tools/analysis/plot_curves.py on a
real work dir.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from tool_runs import DET_CONFIG, ROOT, SEG_CONFIG, TOOLS, _free_port, _load_tool, _log_text, _run, _test_metrics, _tool
from visattn_mm import cli
from visattn_mm import toy_data as toy


@pytest.fixture(scope='module')
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp('cli')


@pytest.fixture(scope='module')
def det_config(workspace) -> Path:
    data = toy.make_coco_instances(workspace / 'toy_coco', num_train=8, num_val=4)
    path = workspace / 'tiny_mask_rcnn.py'
    path.write_text(DET_CONFIG.format(data_root=data, classes=toy.COCO_CLASSES))
    return path


@pytest.fixture(scope='module')
def seg_config(workspace) -> Path:
    data = toy.make_ade20k_layout(workspace / 'toy_ade', num_train=8, num_val=3)
    path = workspace / 'tiny_upernet.py'
    path.write_text(SEG_CONFIG.format(data_root=data, classes=toy.ADE_CLASSES, num_classes=len(toy.ADE_CLASSES)))
    return path


@pytest.fixture(scope='module')
def det_trained(workspace, det_config) -> Path:
    """Train the detector for 4 iterations; returns its work dir."""
    work_dir = workspace / 'det'
    _run(_tool('train.py', det_config, '--work-dir', work_dir), cwd=workspace)
    return work_dir


# --------------------------------------------------------------------------
# Detection: train, resume, test
# --------------------------------------------------------------------------
def test_det_train_writes_checkpoints_and_validates(det_trained):
    assert (det_trained / 'iter_2.pth').is_file()
    assert (det_trained / 'iter_4.pth').is_file()
    assert (det_trained / 'last_checkpoint').read_text().strip().endswith('iter_4.pth')
    log = _log_text(det_trained)
    assert 'coco/bbox_mAP' in log and 'coco/segm_mAP' in log


def test_mmengine_checkpoint_needs_compat_and_loads_with_it(det_trained):
    ckpt = det_trained / 'iter_4.pth'
    # Plain torch refuses the file: this is why compat exists.
    probe = subprocess.run(
        [sys.executable, '-c', f'import torch; torch.load({str(ckpt)!r})'], capture_output=True, text=True, timeout=120
    )
    assert probe.returncode != 0 and 'Weights only load failed' in probe.stderr

    from visattn_mm.compat import allow_mmengine_checkpoints

    assert allow_mmengine_checkpoints()
    count = len(torch.serialization.get_safe_globals())
    assert allow_mmengine_checkpoints()  # idempotent: nothing added twice
    assert len(torch.serialization.get_safe_globals()) == count
    loaded = torch.load(ckpt, weights_only=True, map_location='cpu')
    assert loaded['meta']['iter'] == 4
    assert 'message_hub' in loaded and 'optimizer' in loaded


def test_import_leaves_the_allowlist_and_our_reads_load_runner_checkpoints(det_trained):
    """``import visattn_mm`` adds nothing to torch's weights-only allowlist (timm and mmengine add their
    own); read_checkpoint still loads a Runner checkpoint weights-only, and leaves the allowlist as it was."""
    code = f"""
import torch, timm, mmengine.runner
def allowed():
    return sorted(map(repr, torch.serialization.get_safe_globals()))
before = allowed()
import visattn_mm
from visattn_mm.checkpoint import read_checkpoint
assert allowed() == before, 'import'
checkpoint = read_checkpoint({str(det_trained / 'iter_4.pth')!r})
assert checkpoint['meta']['iter'] == 4 and 'message_hub' in checkpoint
assert allowed() == before, 'read'
print('ok')
"""
    probe = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
    assert probe.returncode == 0 and probe.stdout.strip().endswith('ok'), probe.stderr[-3000:]
    assert 'unpickling it fully' not in probe.stderr  # read weights-only, not through the fallback


def test_det_resume_continues_from_checkpoint(det_trained, det_config, workspace):
    _run(
        _tool(
            'train.py',
            det_config,
            '--work-dir',
            det_trained,
            '--resume',
            det_trained / 'iter_4.pth',
            '--cfg-options',
            'train_cfg.max_iters=6',
            'train_cfg.val_interval=100',
        ),
        cwd=workspace,
    )
    log = _log_text(det_trained)
    assert 'resumed epoch: 0, iter: 4' in log
    assert 'Iter(train) [5/6]' in log and 'Iter(train) [1/6]' not in log
    from visattn_mm.compat import allow_mmengine_checkpoints

    allow_mmengine_checkpoints()
    ckpt = torch.load(det_trained / 'iter_6.pth', weights_only=True, map_location='cpu')
    assert ckpt['meta']['iter'] == 6


def test_det_test_reports_coco_metrics_and_draws(det_trained, det_config, workspace):
    work_dir = workspace / 'det_test'
    show_dir = workspace / 'det_vis'
    out = workspace / 'det_preds.pkl'
    proc = _run(
        _tool(
            'test.py',
            det_config,
            det_trained / 'iter_4.pth',
            '--work-dir',
            work_dir,
            '--show-dir',
            show_dir,
            '--out',
            out,
        ),
        cwd=workspace,
    )
    metrics = _test_metrics(work_dir)
    for key in ('coco/bbox_mAP', 'coco/bbox_mAP_50', 'coco/segm_mAP'):
        assert isinstance(metrics[key], float), key
    assert len(list(show_dir.glob('*.png'))) == 4  # one painted image per val image
    assert proc.stdout.splitlines()[-1] == f'[visattn_mm] painted predictions (4 images): {show_dir}'
    assert out.is_file() and out.stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason='exercises the CPU-only (gloo) path')
def test_dist_train_two_cpu_processes(det_config, workspace):
    work_dir = workspace / 'det_dist'
    # nccl, as mmdet's default_runtime sets it: the tool must switch to gloo.
    proc = _run(
        [
            'bash',
            str(TOOLS / 'dist_train.sh'),
            det_config,
            '2',
            '--work-dir',
            work_dir,
            '--cfg-options',
            'train_cfg.max_iters=2',
            'train_cfg.val_interval=2',
            'env_cfg.dist_cfg.backend=nccl',
        ],
        cwd=workspace,
        env=dict(PYTHON=sys.executable, PORT=str(_free_port())),
    )
    assert "using backend 'gloo' instead of 'nccl'" in proc.stderr
    assert (work_dir / 'iter_2.pth').is_file()
    log = _log_text(work_dir)
    assert 'Distributed training: True' in log and 'GPU number: 2' in log
    assert 'Iter(train) [2/2]' in log and 'coco/bbox_mAP' in log


# --------------------------------------------------------------------------
# Segmentation: train, test
# --------------------------------------------------------------------------
@pytest.fixture(scope='module')
def seg_trained(workspace, seg_config) -> Path:
    """Train the segmentor for 4 iterations; returns its work dir."""
    work_dir = workspace / 'seg'
    _run(_tool('train.py', seg_config, '--work-dir', work_dir), cwd=workspace)
    return work_dir


def test_seg_train_and_test(seg_trained, seg_config, workspace):
    ckpt = seg_trained / 'iter_4.pth'
    assert ckpt.is_file()
    assert 'mIoU' in _log_text(seg_trained)

    test_dir, show_dir, out = (workspace / n for n in ('seg_test', 'seg_vis', 'seg_out'))
    # SegVisualizationHook draws every `interval`-th image (default 50).
    proc = _run(
        _tool(
            'test.py',
            seg_config,
            ckpt,
            '--work-dir',
            test_dir,
            '--show-dir',
            show_dir,
            '--out',
            out,
            '--cfg-options',
            'default_hooks.visualization.interval=1',
        ),
        cwd=workspace,
    )
    metrics = _test_metrics(test_dir)
    for key in ('aAcc', 'mIoU', 'mAcc'):
        assert isinstance(metrics[key], float), key
    assert len(list((show_dir / 'vis_data' / 'vis_image').glob('*.png'))) == 3
    assert f'[visattn_mm] painted predictions (3 images): {show_dir}/vis_data/vis_image' in proc.stdout
    assert len(list(out.glob('*.png'))) == 3


# --------------------------------------------------------------------------
# Test-time augmentation, end to end on the trained models
# --------------------------------------------------------------------------
def test_det_test_tta_merges_boxes_and_masks(det_trained, det_config, workspace):
    work_dir, out = workspace / 'det_tta', workspace / 'det_tta.pkl'
    proc = _run(
        _tool('test.py', det_config, det_trained / 'iter_4.pth', '--tta', '--work-dir', work_dir, '--out', out),
        cwd=workspace,
    )
    metrics = _test_metrics(work_dir)
    for key in ('coco/bbox_mAP', 'coco/segm_mAP'):
        assert isinstance(metrics[key], float), key
    import pickle

    with open(out, 'rb') as f:
        results = pickle.load(f)
    assert len(results) == 4
    for result in results:
        pred = result['pred_instances']
        assert 0 < len(pred['scores']) <= 100  # the TTA model's max_per_img
        assert len(pred['masks']) == len(pred['scores'])  # RLE-encoded, one per box
    assert 'InstanceAwareDetTTAModel' in proc.stdout + proc.stderr + _log_text(work_dir)


def test_seg_test_tta_writes_predictions(seg_trained, seg_config, workspace):
    test_dir, out = workspace / 'seg_tta', workspace / 'seg_tta_out'
    # One validation image: 6 scales x 2 flips make TTA 12 times as slow.
    _run(
        _tool(
            'test.py',
            seg_config,
            seg_trained / 'iter_4.pth',
            '--tta',
            '--work-dir',
            test_dir,
            '--out',
            out,
            '--cfg-options',
            'test_dataloader.dataset.indices=1',
        ),
        cwd=workspace,
    )
    metrics = _test_metrics(test_dir)
    for key in ('aAcc', 'mIoU', 'mAcc'):
        assert isinstance(metrics[key], float), key
    assert len(list(out.glob('*.png'))) == 1
    assert "'SegTTAModel'" in _log_text(test_dir)


# --------------------------------------------------------------------------
# Option handling, in-process (no training)
# --------------------------------------------------------------------------
@pytest.fixture(scope='module')
def train_tool():
    return _load_tool('train')


@pytest.fixture(scope='module')
def test_tool():
    return _load_tool('test')


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the CPU-only refusal')
def test_amp_on_cpu_refuses_clearly(train_tool):
    cfg = Config(dict(optim_wrapper=dict(type='OptimWrapper', optimizer=dict(type='SGD'))))
    with pytest.raises(SystemExit, match='--amp: mixed precision needs a GPU'):
        train_tool.apply_amp(cfg)


def test_resume_and_work_dir_options(train_tool):
    cfg = Config(dict(resume=False, load_from='pretrained.pth'))
    train_tool.apply_resume(cfg, None)
    assert cfg.resume is False and cfg.load_from == 'pretrained.pth'
    train_tool.apply_resume(cfg, 'auto')
    assert cfg.resume is True and cfg.load_from is None
    train_tool.apply_resume(cfg, 'x/iter_4.pth')
    assert cfg.resume is True and cfg.load_from == 'x/iter_4.pth'

    cli.set_work_dir(cfg, None, 'configs/some/vil_s_mask-rcnn.py')
    assert cfg.work_dir == os.path.join('./work_dirs', 'vil_s_mask-rcnn')
    cli.set_work_dir(cfg, 'elsewhere', 'configs/x.py')
    assert cfg.work_dir == 'elsewhere'

    with pytest.raises(SystemExit, match='auto_scale_lr'):
        train_tool.apply_auto_scale_lr(Config(dict()))
    cfg = Config(dict(auto_scale_lr=dict(enable=False, base_batch_size=16)))
    train_tool.apply_auto_scale_lr(cfg)
    assert cfg.auto_scale_lr.enable is True


def test_unknown_scope_is_rejected(train_tool):
    with pytest.raises(SystemExit, match='default_scope'):
        cli.register_scope_modules(Config(dict(default_scope='mmpretrain')))


def test_show_dir_follows_each_library(test_tool):
    args = Namespace(show=False, show_dir='vis', wait_time=2)
    det = Config(dict(default_hooks=dict(visualization=dict(type='DetVisualizationHook'))))
    test_tool.apply_visualization(det, 'mmdet', args)
    assert det.default_hooks.visualization == dict(type='DetVisualizationHook', draw=True, test_out_dir='vis')
    seg = Config(
        dict(
            default_hooks=dict(visualization=dict(type='SegVisualizationHook')),
            visualizer=dict(type='SegLocalVisualizer'),
        )
    )
    test_tool.apply_visualization(seg, 'mmseg', Namespace(show=True, show_dir='vis', wait_time=1))
    assert seg.default_hooks.visualization == dict(type='SegVisualizationHook', draw=True, show=True, wait_time=1)
    assert seg.visualizer.save_dir == 'vis'
    with pytest.raises(SystemExit, match='visualization'):
        test_tool.apply_visualization(Config(dict(default_hooks=dict())), 'mmdet', args)


def _view(flip: bool, boxes, scores, labels, masks):
    """A DetDataSample of one TTA view of an 8x10 image."""
    from mmdet.structures import DetDataSample
    from mmengine.structures import InstanceData

    sample = DetDataSample(metainfo=dict(ori_shape=(8, 10), flip=flip, flip_direction='horizontal' if flip else None))
    sample.pred_instances = InstanceData(
        bboxes=torch.tensor(boxes, dtype=torch.float32),
        scores=torch.tensor(scores),
        labels=torch.tensor(labels),
        masks=masks,
    )
    return sample


def test_tta_model_merges_masks_with_their_boxes():
    """Registered by the package itself, so a user's config can name it under mmdet's scope."""
    from mmdet.registry import MODELS

    from visattn_mm.engine.det_tta import InstanceAwareDetTTAModel

    assert MODELS.get('InstanceAwareDetTTAModel') is InstanceAwareDetTTAModel

    class Stub(torch.nn.Module):
        def test_step(self, data):  # BaseTTAModel requires one; never called here
            raise AssertionError

    tta = MODELS.build(
        dict(
            type='InstanceAwareDetTTAModel',
            module=Stub(),
            tta_cfg=dict(nms=dict(type='nms', iou_threshold=0.5), max_per_img=100),
        )
    )
    right = torch.zeros(8, 10, dtype=torch.bool)
    right[:, 7:] = True
    corner = torch.zeros(8, 10, dtype=torch.bool)
    corner[:2, :2] = True
    # The flipped view sees the right-hand object on the left.
    flipped = _view(True, [[0, 0, 3, 8]], [0.9], [0], right.flip(-1)[None])
    plain = _view(False, [[7, 0, 10, 8], [0, 0, 2, 2]], [0.8, 0.5], [0, 1], torch.stack([right, corner]))
    merged = tta.merge_preds([[flipped, plain]])[0].pred_instances
    # NMS keeps the flipped view's 0.9 box over the plain view's duplicate.
    assert merged.scores.tolist() == pytest.approx([0.9, 0.5])
    assert merged.labels.tolist() == [0, 1]
    assert merged.bboxes.tolist() == [[7, 0, 10, 8], [0, 0, 2, 2]]
    assert torch.equal(merged.masks, torch.stack([right, corner]))


@pytest.mark.parametrize('config', ['upernet_vvt_s_160k_ade20k.py', None])
def test_seg_tta_is_multi_scale_and_flip(test_tool, seg_config, config):
    """Real configs inherit mmseg's TTA; configs without one get the same default."""
    path = ROOT / 'configs' / config if config else seg_config
    cfg = Config.fromfile(path)
    test_tool.apply_tta(cfg, 'mmseg')
    assert cfg.model.type == 'SegTTAModel' and 'backbone' in cfg.model.module
    loader, aug = cfg.test_dataloader.dataset.pipeline
    assert loader.type == 'LoadImageFromFile' and aug.type == 'TestTimeAug'
    resizes, flips, *rest = aug.transforms
    assert [t.scale_factor for t in resizes] == [0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
    assert sorted(t.prob for t in flips) == [0.0, 1.0]
    assert [t.type for (t,) in rest] == ['LoadAnnotations', 'PackSegInputs']


def test_det_tta_defaults_to_flip(test_tool, det_config):
    cfg = Config.fromfile(det_config)
    test_tool.apply_tta(cfg, 'mmdet')
    assert cfg.model.type == 'InstanceAwareDetTTAModel' and cfg.model.module.type == 'MaskRCNN'
    aug = cfg.test_dataloader.dataset.pipeline[-1]
    assert aug.type == 'TestTimeAug'
    assert sorted(t.prob for t in aug.transforms[0]) == [0.0, 1.0]


def test_plot_curves_of_a_real_work_dir(det_trained, workspace):
    out = workspace / 'det_curves.png'
    proc = _run(
        [
            sys.executable,
            str(TOOLS / 'analysis' / 'plot_curves.py'),
            det_trained,
            '--keys',
            'loss',
            'lr',
            'coco/bbox_mAP',
            '--out',
            out,
        ],
        cwd=workspace,
    )
    # 4 training iterations (6 if the resume test ran first) and the validation after them.
    assert re.search(r'loss \((4|6) points\), lr \((4|6) points\), coco/bbox_mAP \(1 points\)', proc.stdout), (
        proc.stdout
    )
    assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def _mim_run(*args) -> list[str]:
    return [sys.executable, '-m', 'mim', 'run', *map(str, args)]


def test_mmdet_analyze_logs_and_browse_dataset_through_mim(det_trained, workspace):
    """mmdet's own tools as users run them: ``analyze_logs`` (it imports seaborn, which the stack
    installs) on our work dir's JSON log, ``browse_dataset`` on our demo config."""
    log = sorted(det_trained.glob('*/vis_data/2*.json'))[0]
    out = workspace / 'mmdet_curve.png'
    _run(_mim_run('mmdet', 'analyze_logs', 'plot_curve', log, '--keys', 'loss', 'bbox_mAP', '--out', out), workspace)
    assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert 'average iter time' in _run(_mim_run('mmdet', 'analyze_logs', 'cal_train_time', log), workspace).stdout
    # The demo config reads data/toy_coco/ under the working directory: the toy set of det_config.
    (workspace / 'data').mkdir(exist_ok=True)
    if not (workspace / 'data' / 'toy_coco').exists():
        (workspace / 'data' / 'toy_coco').symlink_to(workspace / 'toy_coco')
    browsed = workspace / 'browsed'
    demo_config = ROOT / 'configs' / 'demo' / 'maskrcnn_vil_t_toy.py'
    _run(_mim_run('mmdet', 'browse_dataset', demo_config, '--output-dir', browsed, '--not-show'), workspace)
    assert len(list(browsed.glob('*.png'))) == 8
