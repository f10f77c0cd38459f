"""What the tools report: the environment (``tools/collect_env.py``, and ``tools/train.py`` at
start), and RngStateHook's warning about a checkpoint without RNG states, which concerns a
resume only: evaluating the checkpoint with ``tools/test.py`` says nothing about it.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

import visattn_mm.ops.cuda_defaults as cuda_defaults
from helpers import build_tiny
from tool_runs import DET_CONFIG, _load_tool, _log_text, _run, _test_metrics, _tool
from visattn_mm import toy_data as toy
from visattn_mm.engine import RngStateHook
from visattn_mm.env_report import attention_paths, plugin_env
from visattn_mm.models import BACKBONES
from visattn_mm.ops import ATTENTION_IMPLS, attention_impl
from visattn_mm.ops.impl import chosen_path
from visattn_mm.ops.specs import OP_SPECS

# The modules of the softmax attentions, which have two torch paths.
OPS_WITH_TWO_PATHS = [importlib.import_module(f'visattn_mm.ops.{spec.name}') for spec in OP_SPECS if spec.softmax]
NO_RNG_STATES = 'RngStateHook: the checkpoint has no RNG states'


# --------------------------------------------------------------------------
# The environment report
# --------------------------------------------------------------------------
def paths_taken(model, training, monkeypatch):
    """``{op module name: {'fast'|'math', ...}}`` over one forward pass on the CPU (each op's one decision)."""
    taken = {}
    for module in OPS_WITH_TWO_PATHS:

        def spy(*args, _op=module.__name__.rsplit('.', 1)[-1], _decide=module.attention_path, **kwargs):
            path = _decide(*args, **kwargs)
            taken.setdefault(_op, set()).add(path)
            return path

        monkeypatch.setattr(module, 'attention_path', spy)
    image = torch.randn(1, 3, 40, 56)
    if training:
        model.train()(image)
    else:
        with torch.no_grad():
            model.eval()(image)
    monkeypatch.undo()
    return taken


@pytest.mark.parametrize('impl', ATTENTION_IMPLS)
@pytest.mark.parametrize('backbone', tuple(BACKBONES))
def test_attention_table_matches_the_paths_backbones_take(backbone, impl, monkeypatch):
    """The report's table of ops and biases predicts the path every op of the backbone takes,
    in training (the RPB trains) and at inference."""
    model = build_tiny(BACKBONES[backbone])
    for training in (True, False):
        with attention_impl(impl):
            taken = paths_taken(model, training, monkeypatch)
            expected = {
                spec.name: {chosen_path('cpu', spec.trained_bias and training)}
                for spec in BACKBONES[backbone].attention_ops
                if spec.softmax
            }
        assert taken == expected, (backbone, impl, training)


def test_attention_lines_name_each_backbone_and_follow_the_selection(monkeypatch):
    monkeypatch.setattr(cuda_defaults, 'CUDA_DEFAULTS', cuda_defaults.unmeasured_rows())
    with attention_impl('auto'):
        auto = plugin_env('cpu')
        assert auto['attention ViL'] == 'sliding_chunk math (training) / fast (inference)'
        assert auto['attention PaleTransformer'] == 'pale fast'
        assert auto['attention VVT'] == 'vicinity torch ops'
        # On CUDA, per dtype, with the defaults table's rows (here none measured; tests/test_ops/test_cuda_defaults.py).
        unmeasured = 'fast on bf16, fp16, fp32 (defaults table: not measured on a GPU yet)'
        assert attention_paths('cuda')['ViLLS'] == f'long_short {unmeasured}, sliding_chunk {unmeasured}'
    with attention_impl('math'):
        assert plugin_env('cpu')['attention ViL'] == 'sliding_chunk math'
        assert plugin_env('cpu')['attention VVT'] == 'vicinity torch ops'
    with attention_impl('triton'):
        assert attention_paths('cuda')['VVT'] == 'vicinity triton'
        assert plugin_env('cpu')['attention VVT'] == 'vicinity torch ops'


def test_collect_env_tool_prints_the_report(capsys):
    _load_tool('collect_env').main()
    lines = dict(line.split(': ', 1) for line in capsys.readouterr().out.splitlines() if ': ' in line)
    for key in (
        'Python',
        'PyTorch',
        'PyTorch CUDA build',
        'CUDA devices',
        'MMCV',
        'MMCV ops',
        'MMEngine',
        'MMDetection',
        'MMSegmentation',
        'timm',
        'Triton',
        'visattn_mm',
        'attention implementation',
    ):
        assert lines.get(key), key
    assert lines['MMCV ops'].startswith('import; built with')
    if not torch.cuda.is_available():
        assert lines['CUDA devices'] == '0'
    for backbone in BACKBONES:
        assert (
            lines[f'attention {backbone}'] == attention_paths('cuda' if torch.cuda.is_available() else 'cpu')[backbone]
        )


# --------------------------------------------------------------------------
# tools/train.py's report, and the RNG-state warning only on resume
# --------------------------------------------------------------------------
@pytest.fixture(scope='module')
def run_without_rng_states(tmp_path_factory):
    """One training iteration of the tiny detector without RngStateHook, and a config that
    adds the hook (for evaluating that checkpoint)."""
    workspace = tmp_path_factory.mktemp('reports')
    data = toy.make_coco_instances(workspace / 'toy_coco', num_train=4, num_val=2)
    plain = workspace / 'tiny.py'
    plain.write_text(DET_CONFIG.format(data_root=data, classes=toy.COCO_CLASSES))
    with_hook = workspace / 'tiny_rng.py'
    with_hook.write_text(f"_base_ = ['{plain}']\ncustom_hooks = [dict(type='RngStateHook')]\n")
    work_dir = workspace / 'work'
    proc = _run(
        _tool(
            'train.py',
            plain,
            '--work-dir',
            work_dir,
            '--cfg-options',
            'train_cfg.max_iters=1',
            'train_cfg.val_interval=100',
            'default_hooks.checkpoint.interval=1',
        ),
        cwd=workspace,
    )
    return dict(
        workspace=workspace,
        with_hook=with_hook,
        work_dir=work_dir,
        checkpoint=work_dir / 'iter_1.pth',
        output=proc.stdout + proc.stderr,
    )


def test_train_logs_the_environment(run_without_rng_states):
    log = _log_text(run_without_rng_states['work_dir'])
    assert 'visattn_mm environment:' in log
    for backbone in BACKBONES:
        assert f'attention {backbone}: ' in log


def test_evaluating_a_checkpoint_says_nothing_about_rng_states(run_without_rng_states):
    run = run_without_rng_states
    assert 'rng_states' not in torch.load(run['checkpoint'], map_location='cpu', weights_only=False)
    test_dir = run['workspace'] / 'test'
    proc = _run(_tool('test.py', run['with_hook'], run['checkpoint'], '--work-dir', test_dir), cwd=run['workspace'])
    assert 'coco/bbox_mAP' in _test_metrics(test_dir)
    output = proc.stdout + proc.stderr + _log_text(test_dir)
    assert "type='RngStateHook'" in output  # the hook was in the run
    assert 'RNG states' not in output


def test_only_a_resume_warns_about_missing_rng_states():
    """The same checkpoint without RNG states: loaded for a new run (``load_from``: evaluation,
    fine-tuning) nothing is said; loaded to resume at iteration 2, the warning comes."""
    for resumed_iter, warns in ((0, False), (2, True)):
        hook = RngStateHook()
        runner = SimpleNamespace(iter=resumed_iter, epoch=0, logger=mock.Mock())
        hook.after_load_checkpoint(runner, dict(state_dict={}))
        hook.before_train_epoch(runner)
        messages = [str(call.args[0]) for call in runner.logger.warning.call_args_list]
        assert any(NO_RNG_STATES in m for m in messages) == warns, messages
