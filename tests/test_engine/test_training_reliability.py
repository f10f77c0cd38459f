"""Training reliability: mixed precision, distributed runs, exact resume, determinism.

The end-to-end runs are real ``tools/train.py`` / ``tools/dist_train.sh``
subprocesses on the tiny detector configs and toy COCO data of
``tests/test_tools/test_tools_cli.py``, with the backbone swapped for one of ours.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

import visattn_mm  # noqa: F401  (registration)
from helpers import BACKBONES, VIL_TINY_ARCH, VVT_TINY_ARCH, assert_dense_outputs, assert_finite_grads, build_tiny
from tool_runs import DET_CONFIG, TOOLS, _free_port, _load_tool, _log_text, _run, _tool
from visattn_mm import toy_data as toy
from visattn_mm.compat import mmengine_checkpoint_globals
from visattn_mm.models import PaleTransformer, ViL, ViLLS, VVT

AMP_DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
DETECTION_SIZE = (800, 1216)
# On a CPU, autocast runs below the detection size. The 2-core CI machine has AVX2 only, no native
# bf16 or fp16 matmuls: Pale-T's forward+backward at 800x1216 took 218 s in bf16 on one
# core of the 2-core machine (9x its fp32 time, in emulated matmuls and per-group convs) and 258 s in
# fp16 on two. bf16 has fp32's exponent range, so a smaller map brings it no nearer overflow; on a
# machine with CUDA this test runs on the GPU at 800x1216, where fp16 overflow would show.
AMP_SIZES = {
    torch.bfloat16: DETECTION_SIZE if AMP_DEVICE == 'cuda' else (400, 608),
    torch.float16: DETECTION_SIZE if AMP_DEVICE == 'cuda' else (224, 320),
}


# --------------------------------------------------------------------------
# Mixed precision
# --------------------------------------------------------------------------
@pytest.fixture(scope='module')
def tiny_preset_backbones():
    """The smallest preset of each backbone, built once for all dtypes."""
    torch.manual_seed(0)
    return {cls: cls(arch='tiny').train() for cls in (ViL, ViLLS, VVT, PaleTransformer)}


@pytest.mark.parametrize('dtype', tuple(AMP_SIZES), ids=str)
@pytest.mark.parametrize('cls', (ViL, ViLLS, VVT, PaleTransformer), ids=lambda c: c.__name__)
def test_autocast_forward_backward_at_detection_size(tiny_preset_backbones, cls, dtype):
    """One forward+backward under autocast at 800x1216 (on a CPU: smaller, see AMP_SIZES):
    the linear layers ran in the autocast dtype, the outputs have their stride's shape, outputs and every
    gradient are finite."""
    model = tiny_preset_backbones[cls].to(AMP_DEVICE)
    model.zero_grad(set_to_none=True)
    linear_dtypes = set()
    handles = [
        m.register_forward_hook(lambda m, i, out: linear_dtypes.add(out.dtype))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    image = torch.randn(1, 3, *AMP_SIZES[dtype], generator=torch.Generator().manual_seed(0))
    try:
        with torch.autocast(AMP_DEVICE, dtype=dtype):
            outs = model(image.to(AMP_DEVICE))
            loss = sum(out.float().pow(2).mean() for out in outs)
    finally:
        for handle in handles:
            handle.remove()
    assert linear_dtypes == {dtype}  # autocast really ran in low precision
    assert_dense_outputs(outs, 1, AMP_SIZES[dtype], model.embed_dims, model.strides)
    loss.backward()
    assert_finite_grads(model)


@pytest.mark.parametrize('cls', BACKBONES, ids=lambda c: c.__name__)
def test_fp16_autocast_on_cpu_warns_once(cls, monkeypatch):
    """fp16 autocast on the CPU is many times slower than fp32: said once, with the fix;
    fp32 and bf16 autocast say nothing."""
    from visattn_mm.models import base
    from visattn_mm.ops.process_state import STATE

    monkeypatch.setattr(STATE, 'warnings_given', set())
    model = build_tiny(cls).eval()
    image = torch.randn(1, 3, 32, 32)
    with pytest.warns() as caught, torch.no_grad():
        model(image)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            model(image)
        warnings.warn('control')  # pytest.warns needs at least one warning
        with torch.autocast('cpu', dtype=torch.float16):
            model(image)
            model(image)
    messages = [str(w.message) for w in caught]
    assert messages == ['control', base.CPU_FP16_WARNING]
    assert 'bf16' in messages[1] and 'drop --amp' in messages[1]


def test_mmdet_focal_loss_trains_in_bf16_on_cpu():
    """On CPU mmdet's FocalLoss takes its pure-PyTorch path, which handles bfloat16."""
    from mmdet.models.losses import FocalLoss

    logits = torch.randn(32, 3, generator=torch.Generator().manual_seed(0)).bfloat16()
    logits.requires_grad_(True)
    labels = torch.arange(32) % 4  # 3 = background
    loss = FocalLoss(use_sigmoid=True)(logits, labels)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()


@pytest.fixture(scope='module')
def train_tool():
    return _load_tool('train')


def _amp_retinanet_cfg(dtype, loss_type='FocalLoss'):
    return Config(
        dict(
            model=dict(
                type='RetinaNet', bbox_head=dict(type='RetinaHead', loss_cls=dict(type=loss_type, use_sigmoid=True))
            ),
            optim_wrapper=dict(type='AmpOptimWrapper', dtype=dtype, optimizer=dict(type='SGD')),
        )
    )


def test_bf16_amp_with_focal_loss_is_refused_on_gpu(train_tool):
    with pytest.raises(SystemExit, match="no bfloat16 version.*dtype='float16'"):
        train_tool.refuse_bf16_focal_loss(_amp_retinanet_cfg('bfloat16'), on_cuda=True)


@pytest.mark.parametrize(
    'dtype, loss_type, on_cuda',
    [
        ('bfloat16', 'FocalLoss', False),  # CPU: mmdet's pure-PyTorch focal loss
        ('float16', 'FocalLoss', True),  # mmcv's kernel has a float16 version
        (None, 'FocalLoss', True),  # AmpOptimWrapper's default is float16
        ('bfloat16', 'CrossEntropyLoss', True),  # no focal loss
    ],
)
def test_other_amp_set_ups_are_accepted(train_tool, dtype, loss_type, on_cuda):
    train_tool.refuse_bf16_focal_loss(_amp_retinanet_cfg(dtype, loss_type), on_cuda=on_cuda)


# --------------------------------------------------------------------------
# Distributed: frozen stages and out_indices leave no parameter unused
# (each backbone's gradients: tests/test_models/test_backbone_contract.py; here whole dist runs)
# --------------------------------------------------------------------------
@pytest.fixture(scope='module')
def workspace(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp('reliability')


@pytest.fixture(scope='module')
def toy_coco(workspace) -> Path:
    return toy.make_coco_instances(workspace / 'toy_coco', num_train=8, num_val=4)


def _tiny_detector_cfg(workspace, data_root, validate=False) -> Config:
    base = workspace / 'tiny_mask_rcnn.py'
    base.write_text(DET_CONFIG.format(data_root=data_root, classes=toy.COCO_CLASSES))
    cfg = Config.fromfile(base)
    cfg.custom_imports = dict(imports=['visattn_mm'], allow_failed_imports=False)
    if validate:
        cfg.train_cfg.val_interval = 2
    else:
        cfg.val_dataloader = cfg.val_cfg = cfg.val_evaluator = None
    return cfg


def _use_backbone_strides_8_to_32(model, backbone, channels):
    """Feed stages 1-3 (strides 8, 16, 32) of ``backbone`` to the FPN."""
    model.backbone = dict(backbone, out_indices=(1, 2, 3), frozen_stages=1)
    model.neck.in_channels = [channels] * 3
    model.neck.start_level = 0


def _mask_rcnn_vil_cfg(workspace, data_root, validate=False) -> Config:
    cfg = _tiny_detector_cfg(workspace, data_root, validate)
    _use_backbone_strides_8_to_32(cfg.model, dict(type='ViL', arch=VIL_TINY_ARCH), 32)
    cfg.model.rpn_head.anchor_generator.strides = [8, 16, 32, 64, 128]
    for extractor in ('bbox_roi_extractor', 'mask_roi_extractor'):
        cfg.model.roi_head[extractor].featmap_strides = [8, 16, 32, 64]
    return cfg


@pytest.fixture(scope='module')
def mask_rcnn_vil_config(workspace, toy_coco) -> Path:
    cfg = _mask_rcnn_vil_cfg(workspace, toy_coco)
    cfg.custom_hooks = [dict(type='RandomShiftHook', switch_ratio=0.5)]
    path = workspace / 'mask_rcnn_vil.py'
    cfg.dump(str(path))
    return path


@pytest.fixture(scope='module')
def retinanet_vvt_config(workspace, toy_coco) -> Path:
    cfg = _tiny_detector_cfg(workspace, toy_coco)
    stub = workspace / 'retinanet_model.py'  # Config.fromfile resolves `mmdet::` in _base_ only
    stub.write_text("_base_ = ['mmdet::_base_/models/retinanet_r50_fpn.py']\n")
    cfg.model = Config.fromfile(stub).model
    _use_backbone_strides_8_to_32(cfg.model, dict(type='VVT', arch=VVT_TINY_ARCH), 16)
    cfg.model.neck.out_channels = 32
    cfg.model.bbox_head.update(num_classes=len(toy.COCO_CLASSES), in_channels=32, feat_channels=32, stacked_convs=1)
    cfg.custom_hooks = [dict(type='RngStateHook')]
    path = workspace / 'retinanet_vvt.py'
    cfg.dump(str(path))
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason='exercises the CPU-only (gloo) path')
@pytest.mark.parametrize('config', ['mask_rcnn_vil_config', 'retinanet_vvt_config'])
def test_dist_train_with_frozen_stages(config, request, workspace):
    """Two gloo processes, DDP with find_unused_parameters=False: the second iteration
    would fail with a reduction error if a trainable parameter got no gradient. The
    checkpoint holds both ranks' RNG states (RngStateHook, or RandomShiftHook for ViL)."""
    work_dir = workspace / f'dist_{config}'
    _run(
        [
            'bash',
            str(TOOLS / 'dist_train.sh'),
            request.getfixturevalue(config),
            '2',
            '--work-dir',
            work_dir,
            '--cfg-options',
            'train_cfg.max_iters=2',
        ],
        cwd=workspace,
        env=dict(PYTHON=sys.executable, PORT=str(_free_port())),
    )
    log = _log_text(work_dir)
    assert 'Distributed training: True' in log and 'Iter(train) [2/2]' in log
    with mmengine_checkpoint_globals():  # a Runner checkpoint: numpy and HistoryBuffer inside
        checkpoint = torch.load(work_dir / 'iter_2.pth', weights_only=True)
    assert len(checkpoint['rng_states']) == 2


# --------------------------------------------------------------------------
# Determinism and exact resume
# --------------------------------------------------------------------------
@pytest.fixture(scope='module')
def random_shift_config(workspace, toy_coco) -> Path:
    """ViL Mask R-CNN with every source of randomness on: random shift (all the way),
    drop path, random flips; validation every 2 iterations; deterministic mode; one loss
    logged per iteration."""
    cfg = _mask_rcnn_vil_cfg(workspace, toy_coco, validate=True)
    cfg.model.backbone.drop_path_rate = 0.2
    cfg.custom_hooks = [dict(type='RandomShiftHook', switch_ratio=1.0)]
    cfg.randomness = dict(seed=0, deterministic=True)
    cfg.log_processor = dict(by_epoch=False, window_size=1)
    path = workspace / 'mask_rcnn_vil_random_shift.py'
    cfg.dump(str(path))
    return path


def _train(config, work_dir, *args, max_iters):
    _run(
        _tool('train.py', config, '--work-dir', work_dir, *args, '--cfg-options', f'train_cfg.max_iters={max_iters}'),
        cwd=work_dir.parent,
    )


def _losses_by_iter(run_dir: Path) -> dict:
    """Per-iteration total losses from one run's ``vis_data/scalars.json``."""
    lines = (run_dir / 'vis_data' / 'scalars.json').read_text().splitlines()
    return {record['iter']: record['loss'] for record in map(json.loads, lines) if 'loss' in record}


def _run_dirs(work_dir: Path) -> list:
    return sorted(p for p in work_dir.iterdir() if p.is_dir())


def _file_contents(work_dir: Path) -> dict:
    return {p.relative_to(work_dir): p.read_bytes() for p in work_dir.rglob('*') if p.is_file()}


@pytest.fixture(scope='module')
def uninterrupted_losses(workspace, random_shift_config) -> dict:
    work_dir = workspace / 'uninterrupted'
    _train(random_shift_config, work_dir, max_iters=4)
    (run_dir,) = _run_dirs(work_dir)
    return _losses_by_iter(run_dir)


def test_seeded_deterministic_runs_and_exact_resume(uninterrupted_losses, workspace, random_shift_config):
    """A run stopped after 2 of 4 iterations (and a validation), then resumed with
    ``--resume``: its first 2 losses equal the uninterrupted run's (determinism), the
    resumed 2 as well (exact resume), and the first run's logs and checkpoints are
    untouched."""
    assert sorted(uninterrupted_losses) == [1, 2, 3, 4]
    work_dir = workspace / 'interrupted'
    _train(random_shift_config, work_dir, max_iters=2)
    first = _file_contents(work_dir)
    (first_run,) = _run_dirs(work_dir)
    assert _losses_by_iter(first_run) == {i: uninterrupted_losses[i] for i in (1, 2)}

    _train(random_shift_config, work_dir, '--resume', max_iters=4)
    first_run_after, resumed_run = _run_dirs(work_dir)
    assert first_run_after == first_run  # the resumed run logs into a new timestamped dir
    assert _losses_by_iter(resumed_run) == {i: uninterrupted_losses[i] for i in (3, 4)}
    after = _file_contents(work_dir)
    changed = sorted(path for path, data in first.items() if after.get(path) != data)
    config_name = Path(random_shift_config.name)
    # mmengine re-dumps the config into the work dir; each run keeps its own in its log dir.
    assert changed == [Path('last_checkpoint'), config_name], changed
    assert 'iter_4.pth' in after[Path('last_checkpoint')].decode()
    assert b'max_iters=2' in after[first_run.relative_to(work_dir) / config_name]
    assert b'max_iters=4' in after[resumed_run.relative_to(work_dir) / config_name]
