"""Bad backbone arguments fail at build time with a ValueError naming the argument and what is allowed.

Every case runs three ways: the class itself, and ``MODELS.build`` of the mmdet and the
mmseg registries (what a config does). The cases shared by all four backbones go through
the one validator in ``visattn_mm/models/layers.py``.
"""

import re
import subprocess
from pathlib import Path

import pytest
import torch
from mmdet.registry import MODELS as DET_MODELS
from mmseg.registry import MODELS as SEG_MODELS

from helpers import BACKBONES, TINY_ARCHS
from paths import ROOT
from visattn_mm.models import PaleTransformer, ViL, ViLLS, VVT


def _arch(cls, **over):
    return dict(TINY_ARCHS[cls], **over)


def _common_cases(cls):
    """(kwargs, pattern the message must match) for arguments every backbone takes."""
    return [
        (dict(arch='huge'), r"unknown arch 'huge'; choose one of \["),
        (dict(arch=['tiny']), 'arch must be a preset name or a dict'),
        (dict(arch=dict(depths=(1, 1))), r'missing \[.*embed_dims'),
        (dict(arch=_arch(cls, num_heads=(0, 2, 2, 2))), r"arch\['num_heads'\]\[0\]=0 must be an int >= 1"),
        (dict(arch=_arch(cls, embed_dims=(16.0, 32, 32, 32))), r"arch\['embed_dims'\]\[0\]=16.0 must be an int"),
        (dict(arch=_arch(cls, depths=(1, -1, 1, 1))), r"arch\['depths'\]\[1\]=-1 must be an int >= 0"),
        (dict(arch=_arch(cls, embed_dims=(16, 32, 32))), r'embed_dims needs 4 entries'),
        (dict(arch=_arch(cls, embed_dims=(16, 30, 32, 32), num_heads=(2, 4, 2, 4))), r'embed_dims\[1\]=30'),
        (dict(out_indices=(0, 4)), r'out_indices=\(0, 4\) must be a non-empty subset of \(0, 1, 2, 3\)'),
        (dict(out_indices=()), 'out_indices=.*non-empty subset'),
        (dict(out_indices=(1, 1)), 'out_indices=.*without repeats'),
        (dict(out_indices=(0.0, 1)), 'out_indices=.*subset of'),
        (dict(out_indices=3), r'out_indices=3 must be a list or tuple of stage indices from \(0, 1, 2, 3\)'),
        (dict(frozen_stages=5), r'frozen_stages=5 must be an int in \[-1, 4\]'),
        (dict(frozen_stages=-2), r'frozen_stages=-2 must be an int in \[-1, 4\]'),
        (dict(frozen_stages=1.5), r'frozen_stages=1.5 must be an int'),
        (dict(drop_path_rate=-0.1), r'drop_path_rate=-0.1 must be a number in \[0, 1\)'),
        (dict(drop_path_rate=1.0), r'drop_path_rate=1.0 must be a number in \[0, 1\)'),
        (dict(drop_path_rate='0.1'), r"drop_path_rate='0.1' must be a number"),
        (dict(in_channels=0), r'in_channels=0 must be an int >= 1'),
        (dict(in_channels=-3), r'in_channels=-3 must be an int >= 1'),
    ]


# Window / pale sizes and the other per-model arguments; no upper bound exists for any of
# them (a window or pale larger than the map is clipped to it), so none is tested.
SPECIFIC_CASES = {
    ViL: [
        (dict(window_size=0), r'window_size\[0\]=0 must be an int >= 1'),
        (dict(window_size=-3), r'window_size\[0\]=-3 must be an int >= 1'),
        (dict(window_size=7.5), r'window_size\[0\]=7.5 must be an int >= 1'),
        (dict(window_size=True), r'window_size\[0\]=True must be an int'),
        (dict(window_size=(7, 7)), 'window_size needs 1 or 4 entries'),
        (dict(num_global_tokens=(1, 1, -1, 0)), r'num_global_tokens\[2\]=-1 must be an int >= 0'),
        (dict(num_global_tokens=-1), r'num_global_tokens=-1 must be an int >= 0'),
        (dict(arch=_arch(ViL, patch_sizes=(4, 2, 0, 2))), r'patch_sizes\[2\]=0 must be an int >= 1'),
        (dict(masking_mode=2), r'masking_mode must be one of \(0, -1, 1\)'),
        (dict(masking_mode=1, random_shift=True), 'exact'),
        (dict(shift_mode=9), 'shift_mode must be one of'),
        (dict(attn_types='dense'), r"attn_types\[0\]='dense'; allowed"),
        (dict(mlp_ratio=0), r'mlp_ratio=0 must be a number > 0 giving the \d+-channel MLP'),
        (dict(mlp_ratio=-4.0), r'mlp_ratio=-4.0 must be a number > 0'),
        (dict(mlp_ratio='4'), r"mlp_ratio='4' must be a number > 0"),
        (dict(mlp_ratio=0.01), r'mlp_ratio=0.01 must be a number > 0 giving the \d+-channel MLP at least one'),
    ],
    ViLLS: [
        (dict(window_size=0), r'window_size\[0\]=0 must be an int >= 1'),
        (dict(window_size=2.5), r'window_size\[0\]=2.5 must be an int >= 1'),
        (dict(dp_rank=0), r'dp_rank\[0\]=0 must be an int >= 1'),
        (dict(dp_rank=None), r'dp_rank\[0\]=None must be an int >= 1'),
        (dict(dp_rank=(8, 8)), r'dp_rank needs 1 or 4 entries'),
        (dict(num_global_tokens=-1), r'num_global_tokens=-1 must be an int >= 0'),
        (dict(num_global_tokens=(1, -2, 1, 0)), r'num_global_tokens\[1\]=-2 must be an int >= 0'),
        (dict(mlp_ratio=0), r'mlp_ratio=0 must be a number > 0 giving the \d+-channel MLP'),
        (dict(mlp_ratio=-4.0), r'mlp_ratio=-4.0 must be a number > 0'),
        (dict(mlp_ratio='4'), r"mlp_ratio='4' must be a number > 0"),
        (dict(mlp_ratio=0.01), r'mlp_ratio=0.01 must be a number > 0 giving the \d+-channel MLP at least one'),
        (dict(attn_types='linear'), r"attn_types\[0\]='linear'; allowed: \('sliding_chunk', 'full', 'long_short'\)"),
    ],
    VVT: [
        (dict(fr_ratio=0), 'fr_ratio=0 must be an int >= 1'),
        (dict(bf16_products='fast'), "bf16_products='fast' must be True or False"),
        (dict(se_ratio=1.5), 'se_ratio=1.5 must be an int >= 1'),
        (dict(se_ratio=7), 'not divisible by se_ratio=7'),
        (
            dict(arch=_arch(VVT, embed_dims=(6, 16, 16, 16), num_heads=(2, 2, 2, 4))),
            r'embed_dims\[0\]=6 is not divisible by num_heads\[0\]=2 x fr_ratio=2',
        ),
        (dict(arch=_arch(VVT, mlp_ratios=(4,))), 'mlp_ratios needs 4 entries'),
        (dict(arch=_arch(VVT, mlp_ratios=(4, 0, 4, 4))), r'mlp_ratios\[1\]=0 must be a number > 0'),
        (dict(arch=_arch(VVT, mlp_ratios=(4, 4, -1, 4))), r'mlp_ratios\[2\]=-1 must be a number > 0'),
        (dict(arch=_arch(VVT, mlp_ratios=(None, 4, 4, 4))), r'mlp_ratios\[0\]=None must be a number'),
    ],
    PaleTransformer: [
        (dict(arch=_arch(PaleTransformer, pale_sizes=(7, 0, 7, 7))), r'pale_sizes\[1\]=0 must be an int >= 1'),
        (dict(arch=_arch(PaleTransformer, pale_sizes=(7, -7, 7, 7))), r'pale_sizes\[1\]=-7 must be an int'),
        (dict(arch=_arch(PaleTransformer, pale_sizes=(7, 7, 3.5, 7))), r'pale_sizes\[2\]=3.5 must be an int'),
        (
            dict(arch=_arch(PaleTransformer, num_heads=(2, 3, 2, 4), embed_dims=(8, 18, 16, 16))),
            r'num_heads\[1\]=3 must be even',
        ),
        (dict(arch=_arch(PaleTransformer, pale_sizes=(7,))), 'pale_sizes needs 4 entries'),
        (dict(arch=_arch(PaleTransformer, mlp_ratios=(4, 4))), 'mlp_ratios needs 4 entries'),
        (dict(arch=_arch(PaleTransformer, mlp_ratios=(4, 0, 4, 4))), r'mlp_ratios\[1\]=0 must be a number > 0'),
        (dict(arch=_arch(PaleTransformer, mlp_ratios=(4, 4, -1, 4))), r'mlp_ratios\[2\]=-1 must be a number > 0'),
        (dict(arch=_arch(PaleTransformer, mlp_ratios=(None, 4, 4, 4))), r'mlp_ratios\[0\]=None must be a number'),
    ],
}

CASES = [
    pytest.param(cls, kwargs, pattern, id=f'{cls.__name__}-{i}')
    for cls in BACKBONES
    for i, (kwargs, pattern) in enumerate(_common_cases(cls) + SPECIFIC_CASES[cls])
]

BUILDERS = {
    'class': lambda cls, kwargs: cls(**kwargs),
    'mmdet': lambda cls, kwargs: DET_MODELS.build(dict(type=cls.__name__, **kwargs)),
    'mmseg': lambda cls, kwargs: SEG_MODELS.build(dict(type=cls.__name__, **kwargs)),
}


@pytest.mark.parametrize('route', BUILDERS)
@pytest.mark.parametrize('cls,kwargs,pattern', CASES)
def test_bad_argument_is_a_value_error_at_build_time(cls, kwargs, pattern, route):
    with pytest.raises(ValueError) as err:
        BUILDERS[route](cls, kwargs)
    message = str(err.value)
    assert re.search(pattern, message), message
    assert cls.__name__ in message  # says which backbone, also through the registries


def test_frozen_stage_limit_counts_only_the_built_stages():
    """VVT and Pale build stages only up to the last output, so fewer can be frozen."""
    for cls in (VVT, PaleTransformer):
        with pytest.raises(ValueError, match=r'frozen_stages=3 must be an int in \[-1, 2\] \(2 stages are built'):
            cls(arch=TINY_ARCHS[cls], out_indices=(0, 1), frozen_stages=3)
        assert cls(arch=TINY_ARCHS[cls], out_indices=(0, 1), frozen_stages=2).frozen_stages == 2


@pytest.mark.parametrize('registry', [DET_MODELS, SEG_MODELS], ids=['mmdet', 'mmseg'])
@pytest.mark.parametrize('cls', BACKBONES)
def test_registered_for_mmdet_and_mmseg(cls, registry):
    assert type(registry.build(dict(type=cls.__name__, arch=TINY_ARCHS[cls]))) is cls


@pytest.mark.parametrize('cls', BACKBONES)
def test_pretrained_argument_is_deprecated(cls):
    with pytest.warns(DeprecationWarning, match='init_cfg'):
        model = cls(arch=TINY_ARCHS[cls], pretrained='x.pth')
    assert model.init_cfg == dict(type='Pretrained', checkpoint='x.pth')
    with pytest.raises(ValueError, match='set init_cfg or pretrained, not both'):
        cls(arch=TINY_ARCHS[cls], pretrained='x.pth', init_cfg=dict(type='Pretrained', checkpoint='y.pth'))


@pytest.mark.parametrize('cls', BACKBONES)
def test_edge_values_that_are_allowed_still_build(cls, monkeypatch):
    """The validator's bounds are inclusive where they should be (controls for the cases above); out_indices
    out of order are allowed, with a warning that the maps come in stage order."""
    import visattn_mm.models.layers as layers

    warnings = []
    monkeypatch.setattr(layers, 'print_log', lambda msg, logger=None, level=None: warnings.append((msg, level)))
    model = cls(arch=TINY_ARCHS[cls], out_indices=[3, 0], frozen_stages=4, drop_path_rate=0)
    assert (f'{cls.__name__}: out_indices=(3, 0): the maps come in stage order, (0, 3)', 30) in [
        (msg.split(", as mmdet's")[0], level) for msg, level in warnings
    ]
    assert len(model(torch.zeros(1, 3, 64, 64))) == 2
    assert model.out_indices == (3, 0)
    assert not any(p.requires_grad for p in model.parameters())


# --------------------------------------------------------------------------
# tools/train.py and tools/test.py: what cannot work ends the run in one line, before the Runner starts
# --------------------------------------------------------------------------
def _one_line_failure(proc):
    """The run's whole output (stdout and stderr) when it failed: a single line."""
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 1, output[-3000:]
    assert '\n' not in output, output[-3000:]
    return output


def test_training_without_data_names_the_missing_file_in_one_line(tmp_path):
    """The README's training command where no data was put: one line naming the file and the docs."""
    from tool_runs import ROOT, _tool

    proc = subprocess.run(
        _tool('train.py', ROOT / 'configs' / 'maskrcnn_vil_s_1x.py'), cwd=tmp_path, capture_output=True, text=True
    )
    line = _one_line_failure(proc)
    missing = 'data/coco/annotations/instances_train2017.json (ann_file)'
    assert line.startswith(f'error: train_dataloader: {missing} does not exist, nor do train_dataloader: data/coco/')
    assert line.count('data/coco/') == 5  # every missing file named
    assert 'docs/training.md#data-layout' in line


@pytest.mark.parametrize(
    'option,message',
    [
        ('model.backbone.arch=smal', "error: model.backbone: ViL: unknown arch 'smal'; choose one of ["),
        ('optim_wrapper.type=AmpOptimWrapper', 'error: mixed precision needs a GPU'),
    ],
)
def test_config_mistakes_end_training_in_one_line(option, message, tmp_path, monkeypatch):
    from tool_runs import ROOT, _tool

    if option.startswith('optim_wrapper'):
        import torch

        if torch.cuda.is_available():
            pytest.skip('mixed precision runs here')
    proc = subprocess.run(
        _tool('train.py', ROOT / 'configs' / 'maskrcnn_vil_t_1x.py', '--cfg-options', option),
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert _one_line_failure(proc).startswith(message)


def test_data_check_follows_data_root_wrappers_and_evaluators(tmp_path):
    """Every annotation file, image folder and evaluator file a config names, data_root applied, through
    dataset wrappers; nothing once they exist."""
    from mmengine.config import Config

    from visattn_mm import cli as common

    cfg = Config.fromfile(str(ROOT / 'configs' / 'upernet_vil_t_160k_ade20k.py'))
    root = tmp_path / 'ade'
    for part in ('train_dataloader', 'test_dataloader'):
        cfg[part].dataset.data_root = str(root)
    cfg.train_dataloader.dataset = dict(type='RepeatDataset', times=2, dataset=cfg.train_dataloader.dataset)
    parts = ('train_dataloader', 'test_dataloader', 'test_evaluator')
    missing = common.missing_data(cfg, parts)
    assert missing == [
        f'train_dataloader: {root}/images/training (data_prefix.img_path)',
        f'train_dataloader: {root}/annotations/training (data_prefix.seg_map_path)',
        f'test_dataloader: {root}/images/validation (data_prefix.img_path)',
        f'test_dataloader: {root}/annotations/validation (data_prefix.seg_map_path)',
    ]
    for entry in missing:
        Path(entry.split(': ', 1)[1].split(' (')[0]).mkdir(parents=True)
    assert common.missing_data(cfg, parts) == []
    cfg.test_evaluator = dict(type='CocoMetric', ann_file=str(tmp_path / 'val.json'))
    with pytest.raises(SystemExit, match=f'error: test_evaluator: {tmp_path}/val.json \\(ann_file\\) does not exist;'):
        common.check_data(cfg, parts)
