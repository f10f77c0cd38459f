"""What the tools print: a config mistake anywhere in the model ends tools/train.py and tools/test.py in
one line naming the key, before the data is read; the optimizer constructor summarises its parameter
groups in a few lines; the demo's console folds each stage's output into one line and a log file;
tools/test.py --show-dir says where the pictures went."""

from __future__ import annotations

import copy
import io
import logging
import re
import subprocess
import sys

import pytest
from mmengine.config import Config
from torch import nn

from tool_runs import DET_CONFIG, ROOT, SEG_CONFIG, _load_tool, _tool
from visattn_mm import cli

# At most this many lines for a config mistake (the brief of the tools: one line, a little slack for
# warnings a library may print on import).
MAX_ERROR_LINES = 5


def _failure_lines(proc):
    """The lines of a run that must have failed with status 1."""
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert proc.returncode == 1, '\n'.join(lines[-40:])
    return lines


@pytest.mark.parametrize(
    'tool,config,option,expected',
    [
        (
            'train.py',
            'maskrcnn_vil_t_1x.py',
            'model.neck.out_channel=128',
            "error: model.neck.out_channel: FPN.__init__() got an unexpected keyword argument 'out_channel' "
            '(did you mean out_channels?)',
        ),
        (
            'test.py',
            'upernet_vil_t_160k_ade20k.py',
            'model.decode_head.num_class=150',
            "error: model.decode_head.num_class: BaseDecodeHead.__init__() got an unexpected keyword argument "
            "'num_class' (did you mean num_classes?)",
        ),
    ],
)
def test_model_mistakes_end_the_tools_in_one_line_before_the_data(tool, config, option, expected, tmp_path):
    """Run where no data is: had the data been read first, the line would name a missing file."""
    args = [ROOT / 'configs' / config] + (['no_checkpoint.pth'] if tool == 'test.py' else [])
    proc = subprocess.run(
        _tool(tool, *args, '--cfg-options', option), cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    lines = _failure_lines(proc)
    assert len(lines) <= MAX_ERROR_LINES and lines[-1] == expected, lines


@pytest.fixture(scope='module')
def det_cfg(tmp_path_factory):
    from visattn_mm import toy_data as toy

    cfg = Config.fromstring(
        DET_CONFIG.format(data_root=tmp_path_factory.mktemp('nodata'), classes=toy.COCO_CLASSES), '.py'
    )
    cli.register_scope_modules(cfg)
    return cfg


def _model_error(cfg, scope, **changes):
    """The line check_model ends the run with after ``changes`` ({'dotted.key': value}) to the config."""
    cfg = copy.deepcopy(cfg)
    cfg.merge_from_dict(changes)
    with pytest.raises(SystemExit) as raised:
        cli.check_model(cfg, scope)
    return str(raised.value)


def test_model_check_names_the_key_of_head_and_type_mistakes(det_cfg):
    """Heads built inside other modules (a RoI head's box head), unknown types, wrong values, a typo with
    no near name (then the class's arguments are listed, those of the bases it passes ``**kwargs`` to
    included); a correct config passes."""
    cli.check_model(det_cfg, 'mmdet')
    assert _model_error(det_cfg, 'mmdet', **{'model.roi_head.bbox_head.num_classe': 3}) == (
        "error: model.roi_head.bbox_head.num_classe: BBoxHead.__init__() got an unexpected keyword argument "
        "'num_classe' (did you mean num_classes?)"
    )
    line = _model_error(det_cfg, 'mmdet', **{'model.rpn_head.colour': 'red'})
    assert line.startswith("error: model.rpn_head.colour: AnchorHead.__init__() got an unexpected keyword argument")
    assert '(RPNHead takes in_channels, num_classes, init_cfg, num_convs, feat_channels, anchor_generator, ' in line
    assert _model_error(det_cfg, 'mmdet', **{'model.neck.type': 'FPM'}).startswith(
        'error: model.neck: FPM is not in the mmdet::model registry'
    )
    assert _model_error(det_cfg, 'mmdet', **{'model.backbone.depth': 19}).startswith(
        'error: model.backbone (ResNet): invalid depth 19 for resnet'
    )
    seg = Config.fromstring(SEG_CONFIG.format(data_root='nowhere', classes=('a', 'b'), num_classes=2), '.py')
    cli.register_scope_modules(seg)
    assert _model_error(seg, 'mmseg', **{'model.auxiliary_head': dict(type='FCNHead', in_channel=64)}).startswith(
        "error: model.auxiliary_head.in_channel: BaseDecodeHead.__init__() got an unexpected keyword argument"
    )


def test_describe_build_error_outside_the_config():
    """An error outside any registry build, or in a class the config does not name (built in code), names
    what it can."""
    from mmdet.registry import MODELS

    assert cli.describe_build_error(dict(type='MaskRCNN'), ValueError('bad value')) == 'model: bad value'
    with pytest.raises(AssertionError) as raised:
        MODELS.build(dict(type='FPN', in_channels=[2], out_channels=2, num_outs=0))
    assert cli.describe_build_error(dict(type='MaskRCNN'), raised.value) == 'model (FPN): AssertionError'


def test_missing_data_names_every_file(tmp_path):
    cfg = Config(
        dict(
            train_dataloader=dict(
                dataset=dict(data_root=str(tmp_path), ann_file='a.json', data_prefix=dict(img='img/'))
            ),
            val_evaluator=dict(ann_file=str(tmp_path / 'b.json')),
        )
    )
    with pytest.raises(SystemExit) as raised:
        cli.check_data(cfg, ('train_dataloader', 'val_evaluator'))
    assert str(raised.value).startswith(
        f'error: train_dataloader: {tmp_path}/a.json (ann_file) does not exist, nor do '
        f'train_dataloader: {tmp_path}/img/ (data_prefix.img), val_evaluator: {tmp_path}/b.json (ann_file); '
    )


# --------------------------------------------------------------------------
# The optimizer constructor's summary
# --------------------------------------------------------------------------
class _Net(nn.Module):
    """A 'backbone' with a norm and a frozen layer, and a 'head'."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)
        self.backbone[2].requires_grad_(False)


def _build_with_log(model, paramwise_cfg, level=logging.INFO):
    """Build the optimizer through our constructor; returns the wrapper and the log it wrote."""
    from mmengine.logging import MMLogger
    from mmengine.optim import build_optim_wrapper

    import visattn_mm  # noqa: F401  (registers the constructor)

    stream = io.StringIO()
    logger = MMLogger.get_current_instance()
    handler = logging.StreamHandler(stream)
    handler.setLevel(level)
    logger.addHandler(handler)
    try:
        wrapper = build_optim_wrapper(
            model,
            dict(
                type='OptimWrapper',
                constructor='PlainGroupsOptimWrapperConstructor',
                optimizer=dict(type='AdamW', lr=1e-3, weight_decay=0.05),
                paramwise_cfg=paramwise_cfg,
            ),
        )
    finally:
        logger.removeHandler(handler)
    return wrapper, stream.getvalue()


def test_optimizer_summary_says_what_the_rules_did():
    model = _Net()
    wrapper, log = _build_with_log(
        model, dict(norm_decay_mult=0.0, bias_decay_mult=0.0, custom_keys={'head': dict(lr_mult=0.1)})
    )
    lines = log.strip().splitlines()
    # Trained: backbone.0 weight and bias, backbone.1 (norm) weight and bias, head weight and bias.
    assert lines[0] == (
        'optimizer: 6 parameter tensors (0.00M values) in 6 groups; 2 frozen tensors (requires_grad=False) left out:'
    )
    # The rows, checked against the groups themselves: every trained tensor in the row of its settings.
    # A custom key replaces the bias and norm rules for what it matches (mmengine's rule): head.bias decays.
    rows = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in wrapper.optimizer.param_groups:
        rows.setdefault((group['lr'], group['weight_decay']), []).extend(names[id(p)] for p in group['params'])
    assert rows == {
        (1e-3, 0.05): ['backbone.0.weight'],
        (1e-3, 0.0): ['backbone.0.bias', 'backbone.1.weight', 'backbone.1.bias'],
        (1e-4, 0.05): ['head.weight', 'head.bias'],
    }
    assert sorted(lines[1:]) == sorted(
        [
            '  lr 0.001, weight_decay 0.05: 1 tensors (0.00M values; backbone 1)',
            '  lr 0.001, weight_decay 0: 3 tensors (0.00M values; backbone 3)',
            '  lr 0.0001, weight_decay 0.05: 2 tensors (0.00M values; head 2)',
        ]
    )
    assert 'paramwise_options' not in log and 'is skipped since' not in log
    # The per-parameter lines are still there at the DEBUG level.
    _, debug_log = _build_with_log(_Net(), dict(norm_decay_mult=0.0), level=logging.DEBUG)
    assert 'paramwise_options -- backbone.1.weight:weight_decay=0.0' in debug_log
    assert 'backbone.2.weight is skipped since its requires_grad=False' in debug_log


def test_optimizer_summary_merges_learning_rates_when_rows_are_many():
    """Layer-wise decay gives each depth its own lr: the rows then differ by weight decay only, with the
    lr range."""
    from visattn_mm.engine.optim_constructor import MAX_SUMMARY_ROWS, summarize_param_groups

    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(MAX_SUMMARY_ROWS + 1)))
    groups = [
        dict(params=[layer.weight], lr=0.1 * 0.5**depth, weight_decay=0.05) for depth, layer in enumerate(model)
    ] + [dict(params=[layer.bias], lr=0.1, weight_decay=0.0) for layer in model]
    lines = summarize_param_groups(model, groups).splitlines()
    assert lines[1:] == [
        f'  lr {0.1 * 0.5**MAX_SUMMARY_ROWS:g} to 0.1, weight_decay 0.05: 9 tensors (0.00M values; '
        + ', '.join(f'{i} 1' for i in range(9))
        + ')',
        '  lr 0.1, weight_decay 0: 9 tensors (0.00M values; ' + ', '.join(f'{i} 1' for i in range(9)) + ')',
    ]


# --------------------------------------------------------------------------
# The demo's console
# --------------------------------------------------------------------------
@pytest.fixture(scope='module')
def demo():
    return _load_tool('run_demo')


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _chatty_command(lines, fail=False):
    """A command printing ``lines`` lines, mmengine's training progress among them (its code one line, as
    the log's first line shows the command)."""
    code = (
        f"[print(f'Iter(train) [{{i + 1:>3}}/{lines}]  loss: 1.0' if i % 10 == 9 else f'line {{i}}') "
        f'for i in range({lines})]' + ('; raise SystemExit(3)' if fail else '')
    )
    return [sys.executable, '-c', code]


def test_demo_stage_is_one_line_and_its_output_a_log(demo, tmp_path):
    stream = io.StringIO()
    console = demo.Console(stages=2, stream=stream)
    console.start('training 40 iterations')
    output = demo.run(_chatty_command(40), tmp_path / 'train.log', console)
    console.finish('done')
    assert len(output.splitlines()) == 41 and output.startswith('$ ')  # the command, then all its lines
    assert stream.getvalue().count('\n') == 1
    assert stream.getvalue().startswith('[1/2] training 40 iterations ... done (')
    # On a terminal, the line shows the iterations reached, rewritten in place.
    terminal = _Terminal()
    console = demo.Console(stages=2, stream=terminal)
    console.start('training')
    demo.run(_chatty_command(40), tmp_path / 'train.log', console)
    console.finish('done')
    shown = terminal.getvalue()
    assert shown.count('\n') == 1 and 'iteration 40/40' in shown and 'line 3' not in shown


def test_failed_demo_stage_shows_the_end_of_its_log(demo, tmp_path, capsys):
    console = demo.Console(stages=1, stream=io.StringIO())
    console.start('training')
    with pytest.raises(SystemExit) as raised:
        demo.run(_chatty_command(50, fail=True), tmp_path / 'train.log', console)
    message = str(raised.value)
    assert message.endswith(f'command failed (3); its whole output: {tmp_path / "train.log"}')
    assert 'line 48' in message and 'line 20' not in message  # the last lines only
    assert re.fullmatch(r'\[1/1\] training \.\.\. FAILED \(\d+ s\)\n', console.stream.getvalue())


# --------------------------------------------------------------------------
# tools/test.py --show-dir
# --------------------------------------------------------------------------
def test_pictures_dir_follows_each_library():
    test_tool = _load_tool('test')
    assert test_tool.pictures_dir('mmdet', 'vis', 'work', '20260101_000000') == 'work/20260101_000000/vis'
    assert test_tool.pictures_dir('mmdet', '/abs/vis', 'work', '20260101_000000') == '/abs/vis'
    assert test_tool.pictures_dir('mmseg', 'vis', 'work', '20260101_000000') == 'vis/vis_data/vis_image'
