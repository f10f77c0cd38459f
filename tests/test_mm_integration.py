"""ViL inside mmdet and mmseg: registration, configs, a real train + COCO evaluation."""

import subprocess
import sys
import textwrap

import pytest
import torch
from mmengine.config import Config

from paths import ROOT
from visattn_mm.toy_data import make_coco_instances

TINY = "dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 32, 32), num_heads=(1, 2, 2, 2))"


def run_python(code, cwd=ROOT, timeout=600):
    """Run code in a fresh interpreter (no registrations leak in from this process); what it printed,
    without mmengine's log lines (a backbone logs its attention implementation when it is built)."""
    proc = subprocess.run(
        [sys.executable, '-c', textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ''.join(line for line in proc.stdout.splitlines(keepends=True) if ' - mmengine - ' not in line)


def test_registered_for_mmdet_in_fresh_process():
    out = run_python(f"""
        import torch, visattn_mm
        from mmdet.registry import MODELS, HOOKS
        from mmengine.registry import init_default_scope
        init_default_scope('mmdet')
        model = MODELS.build(dict(type='ViL', arch={TINY}))
        print(type(model).__name__, len(model(torch.zeros(1, 3, 32, 32))))
        print(HOOKS.get('RandomShiftHook').__name__)
    """)
    assert out.split() == ['ViL', '4', 'RandomShiftHook']


def test_registered_for_mmseg_in_fresh_process():
    out = run_python(f"""
        import torch, visattn_mm
        from mmseg.registry import MODELS
        from mmengine.registry import init_default_scope
        init_default_scope('mmseg')
        model = MODELS.build(dict(
            type='EncoderDecoder',
            backbone=dict(type='ViL', arch={TINY}),
            decode_head=dict(type='FCNHead', in_channels=32, in_index=3, channels=16, num_convs=1,
                             num_classes=4, norm_cfg=dict(type='BN', requires_grad=True))))
        print(type(model.backbone).__name__, tuple(model.extract_feat(torch.zeros(1, 3, 64, 64))[3].shape))
    """)
    assert out.split() == ['ViL', '(1,', '32,', '2,', '2)']


@pytest.mark.parametrize('scope', ['mmdet', 'mmseg'])
def test_config_custom_imports_alone_registers(tmp_path, scope):
    """A config with custom_imports (and no `import visattn_mm` anywhere) builds ViL."""
    cfg_file = tmp_path / 'cfg.py'
    cfg_file.write_text(
        textwrap.dedent(f"""
        default_scope = '{scope}'
        custom_imports = dict(imports=['visattn_mm'], allow_failed_imports=False)
        backbone = dict(type='ViL', arch={TINY})
    """)
    )
    out = run_python(f"""
        from mmengine.config import Config
        from mmengine.registry import init_default_scope
        cfg = Config.fromfile({str(cfg_file)!r})
        init_default_scope(cfg.default_scope)
        from {scope}.registry import MODELS
        print(type(MODELS.build(cfg.backbone)).__name__)
    """)
    assert out.strip() == 'ViL'


@pytest.fixture(scope='module')
def toy_coco(tmp_path_factory):
    return make_coco_instances(tmp_path_factory.mktemp('toy_coco'), num_train=8, num_val=4, seed=1)


def _config_on_toy_data(config, data_root, out_file, **overrides):
    """A paper config with the demo's toy-dataset pieces swapped in (data only)."""
    cfg = Config.fromfile(ROOT / 'configs' / config)
    demo = Config.fromfile(ROOT / 'configs' / 'demo' / 'maskrcnn_vil_t_toy.py')
    for key in ('train_dataloader', 'val_dataloader', 'test_dataloader', 'val_evaluator', 'test_evaluator'):
        cfg[key] = demo[key]
    for loader in (cfg.train_dataloader, cfg.val_dataloader, cfg.test_dataloader):
        loader.dataset.data_root = str(data_root) + '/'
        loader.num_workers, loader.persistent_workers = 0, False
        loader.batch_size = 2
    for evaluator in (cfg.val_evaluator, cfg.test_evaluator):
        evaluator.ann_file = str(data_root / 'annotations' / 'instances_val.json')
    cfg.model.roi_head.bbox_head.num_classes = cfg.model.roi_head.mask_head.num_classes = 3
    cfg.merge_from_dict(overrides)
    cfg.dump(out_file)
    return out_file


def _tool(*args, timeout=900):
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def test_maskrcnn_vil_s_config_trains_and_evaluates(tmp_path, toy_coco):
    """One iteration of configs/maskrcnn_vil_s_1x.py (paper schedule, optimiser, clipping) and a
    COCO evaluation (bbox + segm) of the result, through tools/train.py and tools/test.py. The training
    compiles the backbone's blocks (``compile_blocks``, dynamo alone: Inductor compiles ViL-S's blocks
    for minutes on the CPU) inside mmdet's model and runner, the heads eager; the evaluation is eager
    and loads what the compiled blocks trained."""
    cfg = _config_on_toy_data(
        'maskrcnn_vil_s_1x.py',
        toy_coco,
        tmp_path / 'vil_s_toy.py',
        train_cfg=dict(_delete_=True, type='IterBasedTrainLoop', max_iters=1, val_interval=1),
        param_scheduler=[],
        model=dict(backbone=dict(init_cfg=None)),  # no ImageNet weights here
        default_hooks=dict(checkpoint=dict(by_epoch=False, interval=1)),
    )
    train_out = _tool(
        'tools/train.py',
        cfg,
        '--work-dir',
        tmp_path / 'work',
        '--cfg-options',
        'model.backbone.compile_blocks.backend=eager',
    )
    assert 'ViL: torch.compile built 12 block graph(s) for input size' in train_out, train_out[-2000:]
    checkpoint = tmp_path / 'work' / 'iter_1.pth'
    assert torch.load(checkpoint, map_location='cpu', weights_only=False)['meta']['iter'] == 1
    test_out = _tool('tools/test.py', cfg, checkpoint, '--work-dir', tmp_path / 'work')
    assert 'coco/bbox_mAP' in test_out and 'coco/segm_mAP' in test_out, test_out[-2000:]
