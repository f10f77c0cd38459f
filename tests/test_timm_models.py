"""timm registration of the classification forms: names, configs, sizes, a training step, checkpoints."""
import argparse
import importlib
import warnings

import pytest
import timm
import torch
from mmdet.registry import MODELS
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2

import visattn_mm  # noqa: F401  (registers the timm names)
from visattn_mm import timm_models
from visattn_mm.checkpoint import load_pretrained
from visattn_mm.models import Classifier

NAMES = ([f'vil_{s}' for s in ('tiny', 'small', 'medium', 'base')]
         + [f'vil_ls_{s}' for s in ('tiny', 'small', 'medium', 'base')]
         + [f'vvt_{s}' for s in ('tiny', 'small', 'medium', 'large')]
         + [f'pale_{s}' for s in ('tiny', 'small', 'base')])
# SPEC 6 (classification, 1000-class head), in millions: (expected, tolerance)
PARAMS_M = {'vil_tiny': (6.72, 0.01), 'vil_small': (24.66, 0.01), 'vil_medium': (39.78, 0.01),
            'vil_base': (55.80, 0.01), 'vil_ls_medium': (39.80, 0.01), 'vil_ls_base': (55.83, 0.01),
            'vvt_tiny': (12.88, 0.01), 'vvt_small': (25.49, 0.01), 'vvt_medium': (47.91, 0.01),
            'vvt_large': (61.85, 0.01), 'pale_tiny': (21.8, 0.1), 'pale_small': (48.3, 0.1),
            'pale_base': (85.4, 0.1)}
TINY_PALE = dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 64, 64), num_heads=(2, 2, 2, 2))


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
    assert cfg['crop_pct'] == (0.9 if name.startswith('vvt') else 0.875)   # the papers' eval crops
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
    model = timm.create_model('pale_tiny', num_classes=5, in_chans=3, drop_rate=0.0, drop_path_rate=0.1,
                              arch=TINY_PALE).train()
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-3, weight_decay=0.05)
    groups = {g['weight_decay']: g['params'] for g in optimizer.param_groups}
    assert set(groups) == {0.0, 0.05}
    assert all(p.ndim > 1 for p in groups[0.05])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = LabelSmoothingCrossEntropy(0.1)(model(torch.randn(2, 3, 64, 64)), torch.tensor([1, 3]))
    loss.backward()
    optimizer.step()
    changed = [k for k, v in model.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
    assert 'head.weight' in changed and 'backbone.patch_embed1.proj.weight' in changed


def test_vil_weight_decay_groups():
    model = timm.create_model('vil_tiny', num_classes=5)
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-3, weight_decay=0.05)
    no_decay = {id(p) for g in optimizer.param_groups if g['weight_decay'] == 0 for p in g['params']}
    for name, param in model.named_parameters():
        skip = any(w in name for w in ('relative_position', 'cls_token')) or param.ndim <= 1
        assert (id(param) in no_decay) == skip, name


@pytest.mark.parametrize('name,backbone', [('pale_tiny', dict(type='PaleTransformer', arch='tiny')),
                                           ('vil_small', dict(type='ViL', arch='small'))])
def test_timm_checkpoint_loads_into_mmdet_backbone(name, backbone, tmp_path):
    torch.manual_seed(0)
    model = timm.create_model(name, num_classes=1000)
    state = model.state_dict()
    target = MODELS.build(backbone)
    # bare, timm 1.0 train.py's CheckpointSaver ('state_dict' + pickled args, via file), and 'model'
    bare, saver = tmp_path / 'bare.pth', tmp_path / 'checkpoint-1.pth.tar'
    torch.save(state, bare)
    torch.save({'epoch': 1, 'arch': name, 'state_dict': state, 'optimizer': {}, 'version': 2,
                'args': argparse.Namespace(model=name)}, saver)
    for checkpoint in (str(bare), str(saver), {'model': state}):
        report = load_pretrained(target, checkpoint)
        assert report.missing == [] and report.unexpected == [] and report.mismatched == {}
        assert set(report.fresh) <= {k for k in target.state_dict() if '.norm' in k or k.startswith('norm')}
    key = next(k for k in state if k.endswith('mlp.fc1.weight'))
    assert torch.equal(target.state_dict()[key[len('backbone.'):]], state[key])


def test_timm_train_wrapper_runs_a_script_with_the_names_registered(tmp_path):
    """tools/timm_train.py runs the given script as __main__ (argv shifted) after import visattn_mm;
    a stand-in for timm's train.py checks the names resolve in that process."""
    import subprocess
    import sys
    from pathlib import Path
    script = tmp_path / 'train.py'
    script.write_text("import sys, timm\n"
                      "assert sys.argv[1:] == ['--model', 'pale_tiny'], sys.argv\n"
                      "print(type(timm.create_model(sys.argv[2], num_classes=3)).__name__)\n")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, 'tools/timm_train.py', str(script), '--model', 'pale_tiny'],
                          cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == 'Classifier'
