"""timm registration of the classification forms: names, configs, sizes, a training step, checkpoints,
and timm's generic model checks (as timm's tests/test_models.py runs them) over all fifteen names."""

import argparse
import importlib
import io
import logging
import math
import warnings

import pytest
import timm
import torch
from mmdet.registry import MODELS
from mmengine.logging import MMLogger
from timm.loss import LabelSmoothingCrossEntropy
from timm.models import group_parameters
from timm.optim import create_optimizer_v2

import visattn_mm  # noqa: F401  (registers the timm names)
from paths import ROOT
from visattn_mm import timm_models
from visattn_mm.checkpoint import load_pretrained
from visattn_mm.models import Classifier

NAMES = (
    [f'vil_{s}' for s in ('tiny', 'small', 'medium', 'base')]
    + [f'vil_ls_{s}' for s in ('tiny', 'small', 'medium', 'base')]
    + [f'vvt_{s}' for s in ('tiny', 'small', 'medium', 'large')]
    + [f'pale_{s}' for s in ('tiny', 'small', 'base')]
)
# Classification with a 1000-class head, in millions: (expected, tolerance). The papers' tables and the
# two decimals: docs/backbones.md#parameter-counts-to-two-decimals
PARAMS_M = {
    'vil_tiny': (6.72, 0.01),
    'vil_small': (24.66, 0.01),
    'vil_medium': (39.78, 0.01),
    'vil_base': (55.80, 0.01),
    'vil_ls_medium': (39.80, 0.01),
    'vil_ls_base': (55.83, 0.01),
    'vvt_tiny': (12.88, 0.01),
    'vvt_small': (25.49, 0.01),
    'vvt_medium': (47.91, 0.01),
    'vvt_large': (61.85, 0.01),
    'pale_tiny': (21.8, 0.1),
    'pale_small': (48.3, 0.1),
    'pale_base': (85.4, 0.1),
}
TINY_PALE = dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(2, 2, 2, 2))
SMALL_INPUT = (64, 96)  # (H, W): not 224, not square; ViL's full-attention maps are 4x6 and 2x3
TINY_NAMES = ['vil_tiny', 'vil_ls_tiny', 'vvt_tiny', 'pale_tiny']


def test_names_registered_once_and_reimport_is_harmless():
    assert sorted(n for n in timm.list_models() if n.startswith(('vil', 'vvt', 'pale'))) == sorted(NAMES)
    importlib.import_module('visattn_mm.timm_models')  # cached: no re-registration
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')  # timm warns on overwriting, never raises
        importlib.reload(timm_models)
    assert sorted(n for n in timm.list_models() if n.startswith(('vil', 'vvt', 'pale'))) == sorted(NAMES)


@pytest.mark.parametrize('name', NAMES)
def test_create_model_configs_and_sizes(name):
    model = timm.create_model(name, pretrained=False, num_classes=1000, drop_path_rate=0.2)
    assert isinstance(model, Classifier) and model.num_classes == 1000
    cfg = model.pretrained_cfg
    assert model.default_cfg is cfg and cfg['architecture'] == name
    assert cfg['input_size'] == (3, 224, 224) and cfg['interpolation'] == 'bicubic'
    assert cfg['crop_pct'] == (0.9 if name.startswith('vvt') else 0.875)  # the papers' eval crops
    assert cfg['mean'] == timm.data.IMAGENET_DEFAULT_MEAN and cfg['std'] == timm.data.IMAGENET_DEFAULT_STD
    assert model.get_classifier() is model.head and cfg['classifier'] == 'head'
    assert isinstance(model.get_submodule(cfg['first_conv']), torch.nn.Conv2d)
    if name in PARAMS_M:
        expected, tol = PARAMS_M[name]
        assert abs(sum(p.numel() for p in model.parameters()) / 1e6 - expected) <= tol
    attn_types = [type(stage.blocks[0].attn).__name__ for stage in getattr(model.backbone, 'stages', [])]
    if name.startswith('vil_ls'):
        assert attn_types == ['LongShortAttention'] * 2 + ['FullAttention'] * 2
    elif name.startswith('vil'):
        assert attn_types == ['SlidingChunkAttention'] * 2 + ['FullAttention'] * 2
    nwd = model.no_weight_decay()
    assert all(any(w in n for w in ('relative_position', 'cls_token', 'pos_embed')) for n in nwd)
    assert bool(nwd) == name.startswith('vil')
    # timm's default-cfg consistency (test_model_default_cfgs), without the forward passes
    state = model.state_dict()
    assert cfg['fixed_input_size'] is False and cfg['pool_size'] == (7, 7)  # any size; 224 / 32
    assert model.num_features == model.head_hidden_size == model.feature_info[-1]['num_chs']
    assert [f['reduction'] for f in model.feature_info] == [4, 8, 16, 32]
    assert all(f['module'] in dict(model.named_modules()) for f in model.feature_info)
    assert cfg['first_conv'] + '.weight' in state and cfg['classifier'] + '.weight' in state
    # layer decay groups: stem, one per block (a patch embedding joins the next block, a norm
    # the previous one), the head last; coarse: stem, stages, head
    layer_of = group_parameters(model, model.group_matcher(), reverse=True)
    assert len(set(layer_of.values())) == 1 + _num_blocks(model) + 1
    assert layer_of[cfg['first_conv'] + '.weight'] == 0 and layer_of['head.weight'] == _num_blocks(model) + 1
    assert len(set(group_parameters(model, model.group_matcher(coarse=True), reverse=True).values())) == 6


@pytest.mark.parametrize('name', ['vil_tiny', 'vil_ls_tiny'])
def test_forward_at_224(name):
    model = timm.create_model(name, num_classes=7).eval()
    with torch.no_grad():
        feats = model.forward_features(torch.randn(1, 3, 224, 224))
        assert feats.shape == (1, 384, 7, 7)
        assert model.forward_head(feats, pre_logits=True).shape == (1, 384)
        assert model.forward_head(feats).shape == (1, 7)
    model.reset_classifier(3)
    assert model.num_classes == 3 and model.head.out_features == 3
    model.reset_classifier(0)
    assert isinstance(model.head, torch.nn.Identity)


def test_timm_training_step_pale():
    torch.manual_seed(0)
    # what timm's train.py passes: in_chans, drop_rate and drop_path_rate (global_pool None is dropped)
    model = timm.create_model(
        'pale_tiny', num_classes=5, in_chans=3, drop_rate=0.0, drop_path_rate=0.1, arch=TINY_PALE
    ).train()
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-3, weight_decay=0.05)
    groups = {g['weight_decay']: g['params'] for g in optimizer.param_groups}
    assert set(groups) == {0.0, 0.05}
    assert all(p.ndim > 1 for p in groups[0.05])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = LabelSmoothingCrossEntropy(0.1)(model(torch.randn(2, 3, 64, 64)), torch.tensor([1, 3]))
    loss.backward()
    optimizer.step()
    changed = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert 'head.weight' in changed and 'backbone.stages.0.patch_embed.proj.weight' in changed


def test_vil_weight_decay_groups():
    model = timm.create_model('vil_tiny', num_classes=5)
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-3, weight_decay=0.05)
    no_decay = {id(p) for g in optimizer.param_groups if g['weight_decay'] == 0 for p in g['params']}
    for name, param in model.named_parameters():
        skip = any(w in name for w in ('relative_position', 'cls_token')) or param.ndim <= 1
        assert (id(param) in no_decay) == skip, name


@pytest.mark.parametrize(
    'name,backbone',
    [('pale_tiny', dict(type='PaleTransformer', arch='tiny')), ('vil_small', dict(type='ViL', arch='small'))],
)
def test_timm_checkpoint_loads_into_mmdet_backbone(name, backbone, tmp_path):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=1000)
    state = model.state_dict()
    target = MODELS.build(backbone)
    # bare, timm 1.0 train.py's CheckpointSaver ('state_dict' + pickled args, via file), and 'model'
    bare, saver = tmp_path / 'bare.pth', tmp_path / 'checkpoint-1.pth.tar'
    torch.save(state, bare)
    torch.save(
        {
            'epoch': 1,
            'arch': name,
            'state_dict': state,
            'optimizer': {},
            'version': 2,
            'args': argparse.Namespace(model=name),
        },
        saver,
    )
    for checkpoint in (str(bare), str(saver), {'model': state}):
        report = load_pretrained(target, checkpoint)
        assert report.missing == [] and report.unexpected == [] and report.mismatched == {}
        assert set(report.fresh) <= {k for k in target.state_dict() if '.norm' in k or k.startswith('norm')}
    key = next(k for k in state if k.endswith('mlp.fc1.weight'))
    assert torch.equal(target.state_dict()[key[len('backbone.') :]], state[key])


def test_timm_train_wrapper_runs_a_script_with_the_names_registered(tmp_path):
    """tools/timm_train.py runs the given script as __main__ (argv shifted) after import visattn_mm;
    a stand-in for timm's train.py checks the names resolve in that process."""
    import subprocess
    import sys

    script = tmp_path / 'train.py'
    script.write_text(
        "import sys, timm\n"
        "assert sys.argv[1:] == ['--model', 'pale_tiny'], sys.argv\n"
        "print(type(timm.create_model(sys.argv[2], num_classes=3)).__name__)\n"
    )
    root = ROOT
    proc = subprocess.run(
        [sys.executable, 'tools/timm_train.py', str(script), '--model', 'pale_tiny'],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == 'Classifier'  # after the backbone's build log line


def _tiny(name):
    """A tiny arch of the name's family: the name's layout and defaults, small enough for CI."""
    return dict(
        arch=dict(
            depths=(1, 1, 1, 1),
            embed_dims=(8, 16, 16, 16),
            num_heads=(2, 2, 2, 2) if name.startswith('pale') else (1, 2, 2, 2),
        )
    )


def _num_blocks(model):
    return sum(len(stage.blocks) for stage in model.backbone.stages)


@pytest.mark.parametrize('name', NAMES)
def test_timm_generic_model_checks(name):
    """What timm's tests/test_models.py checks, at a small non-224 input: backward with a
    gradient for every parameter, forward_intermediates against feature_info,
    forward_features/forward_head, reset_classifier (incl. ''), group_matcher."""
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=7, **_tiny(name))
    x = torch.randn(2, 3, *SMALL_INPUT)
    out = model.train()(x)
    assert out.shape == (2, 7)
    out.mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []

    model.eval()
    x = x[:1]
    with torch.no_grad():
        final, maps = model.forward_intermediates(x)
        assert [tuple(m.shape) for m in maps] == [
            (1, f['num_chs'], math.ceil(SMALL_INPUT[0] / f['reduction']), math.ceil(SMALL_INPUT[1] / f['reduction']))
            for f in model.feature_info
        ]
        assert torch.equal(final, model.forward_features(x))
        first, early = model.forward_intermediates(x, indices=[-4], stop_early=True)
        assert torch.equal(early[0], maps[0]) and first.shape == maps[0].shape
        pooled = model.forward_head(final, pre_logits=True)
        assert pooled.shape == (1, model.head_hidden_size)
        model.reset_classifier(0)
        assert model.num_classes == 0 and torch.equal(model.forward_head(final), pooled)
        model.reset_classifier(0, '')
        assert torch.equal(model.forward_head(final), final)
        model.reset_classifier(3, '')  # the head at every position
        assert model.forward_head(final).shape == (1, 3, *final.shape[2:])
    with pytest.raises(ValueError, match='global_pool'):
        model.reset_classifier(5, 'max')
    with pytest.raises(ValueError, match='stage indices'):
        model.forward_intermediates(x, indices=[4])


@pytest.mark.parametrize('name', TINY_NAMES)
def test_features_only_maps_match_the_classifier(name):
    torch.manual_seed(0)
    classifier = timm.create_model(name, **_tiny(name)).eval()
    torch.manual_seed(0)
    features = timm.create_model(name, features_only=True, out_indices=(1, 3), **_tiny(name)).eval()
    assert features.feature_info.channels() == [classifier.feature_info[i]['num_chs'] for i in (1, 3)]
    assert features.feature_info.reduction() == [8, 32]
    x = torch.randn(1, 3, *SMALL_INPUT)
    with torch.no_grad():
        expected = classifier.forward_intermediates(x, indices=(1, 3), intermediates_only=True)
        for got, want in zip(features(x), expected, strict=True):
            assert torch.equal(got, want)
    # head and the last output norm are pruned: every parameter left gets a gradient
    sum(m.mean() for m in features.train()(torch.randn(2, 3, *SMALL_INPUT))).backward()
    assert [n for n, p in features.named_parameters() if p.grad is None] == []
    early = timm.create_model(name, features_only=True, out_indices=(0, 1), **_tiny(name))  # stages 3-4 pruned
    assert [tuple(m.shape[1:]) for m in early(x)] == [
        (c, math.ceil(64 / r), math.ceil(96 / r)) for c, r in zip(early.feature_info.channels(), (4, 8))
    ]
    assert sum(p.numel() for p in early.parameters()) < sum(p.numel() for p in features.parameters())
    assert len(timm.create_model(name, features_only=True, **_tiny(name))(x)) == 4  # default: all stages


@pytest.mark.parametrize('name', ['vil_tiny', 'vil_ls_tiny'])
def test_full_attention_classifiers_take_any_size_and_img_size(name):
    """Other sizes resize the full-attention tables; img_size= sizes the tables (and loads 224 ones)."""
    model = timm.create_model(name, num_classes=5, **_tiny(name)).eval()
    with torch.no_grad():
        for size in ((224, 224), (160, 288), (33, 47)):
            assert model(torch.randn(1, 3, *size)).shape == (1, 5)
    at_288 = timm.create_model(name, num_classes=5, img_size=288, **_tiny(name))
    full = [m for m in at_288.modules() if type(m).__name__ == 'FullAttention']
    assert {m.rpb_size for m in full} == {(18, 18), (9, 9)}
    at_288.load_state_dict(model.state_dict())  # 224 tables resized by the load pre-hook
    with pytest.raises(ValueError, match='img_size'):
        timm.create_model(name, img_size=(224,), **_tiny(name))


def test_img_size_is_accepted_where_nothing_depends_on_it():
    model = timm.create_model('pale_tiny', img_size=96, **_tiny('pale'))
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 1000)


def _official_files(tmp_path):
    """Official-format release files (tiny archs) of ViL, ViL-LS and VVT, with their model kwargs."""
    from test_vil_ls import official_vil_ls_checkpoint
    from test_vvt import official_vvt_checkpoint

    from helpers import official_vil_checkpoint

    spec = dict(depths=(1, 1, 1, 1), dims=(8, 16, 16, 16), heads=(1, 2, 2, 2))
    files = {}
    for name, checkpoint in (
        ('vil_tiny', official_vil_checkpoint(spec)),
        ('vil_ls_tiny', official_vil_ls_checkpoint(spec)),
        ('vvt_tiny', official_vvt_checkpoint(dict(spec, mlp=(4, 4, 4, 4)))),
    ):
        files[name] = tmp_path / f'{name}_official.pth'
        torch.save(checkpoint, files[name])
    return files


def test_official_release_loads_in_one_call(tmp_path):
    """pretrained_cfg_overlay=dict(file=...) and checkpoint_path= convert an official release
    (container, module. prefix, layout, head) with our load report; both give the same model."""
    from visattn_mm.checkpoint import read_checkpoint, unwrap_state_dict

    for name, path in _official_files(tmp_path).items():
        official, _ = unwrap_state_dict(read_checkpoint(str(path)))
        file_cfg = dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **_tiny(name))
        via_cfg = timm.create_model(name, **file_cfg)
        via_path = timm.create_model(name, checkpoint_path=str(path), **_tiny(name))
        assert torch.equal(via_cfg.head.weight, official['head.weight'])
        last_norm = 'norm3' if name.startswith('vil') else 'stages.3.norm'
        official_norm = official['norm.weight' if name.startswith('vil') else 'norm4.weight']
        assert torch.equal(via_cfg.backbone.state_dict()[f'{last_norm}.weight'], official_norm)
        for key, value in via_cfg.state_dict().items():
            assert torch.equal(value, via_path.state_dict()[key]), key
        # another number of classes: the head stays fresh, the rest loads; features_only loads too
        ten = timm.create_model(name, num_classes=10, **file_cfg)
        assert torch.equal(ten.backbone.state_dict()[f'{last_norm}.weight'], official_norm)
        features = timm.create_model(name, features_only=True, **file_cfg)
        assert torch.equal(
            features.model.backbone.stages[0].patch_embed.proj.weight,
            via_cfg.backbone.stages[0].patch_embed.proj.weight,
        )


def test_official_load_is_reported_and_strict(tmp_path):
    path = _official_files(tmp_path)['vil_tiny']
    logged = io.StringIO()
    handler = logging.StreamHandler(logged)
    MMLogger.get_current_instance().addHandler(handler)
    try:
        model = timm.create_model('vil_tiny', checkpoint_path=str(path), **_tiny('vil'))
    finally:
        MMLogger.get_current_instance().removeHandler(handler)
    assert "layout 'vil_official'" in logged.getvalue() and 'missing: 0' in logged.getvalue()
    # timm reads the file of pretrained_cfg_overlay itself; the report still names it.
    logged.seek(0)
    logged.truncate()
    MMLogger.get_current_instance().addHandler(handler)
    try:
        timm.create_model('vil_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **_tiny('vil'))
    finally:
        MMLogger.get_current_instance().removeHandler(handler)
    assert f'checkpoint {path}: container' in logged.getvalue()
    with pytest.raises(RuntimeError, match='did not load'):  # head of another size, strict
        timm.create_model('vil_tiny', num_classes=10, checkpoint_path=str(path), **_tiny('vil'))
    ours = timm.create_model('vil_tiny', **_tiny('vil'))
    ours.load_state_dict({'state_dict': model.state_dict(), 'epoch': 3})  # our layout in a container
    assert torch.equal(ours.head.weight, model.head.weight)
