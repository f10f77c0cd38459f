"""ViL-LS (Transformer-LS) backbone: fidelity, official checkpoints, dense-prediction surface."""
import copy
import importlib
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

import visattn_mm  # noqa: F401
from visattn_mm.checkpoint import load_pretrained
from visattn_mm.models import Classifier, ViLLS
from visattn_mm.models.vil import LongShortAttention, SlidingChunkAttention

ROOT = Path(__file__).resolve().parents[1]
TINY_ARCH = dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 32, 32), num_heads=(1, 2, 2, 2))
CLS_LAYOUT = ('long_short', 'long_short', 'full', 'full')
MEDIUM = dict(depths=(1, 4, 16, 1), dims=(96, 192, 384, 768), heads=(3, 3, 6, 12))
LS_TINY = dict(depths=(1, 1, 9, 1), dims=(48, 96, 192, 384), heads=(1, 3, 3, 6))


def official_vil_ls_checkpoint(spec, seed=0, img_size=224, window=7, rank=8):
    """An official ViL-LS classification checkpoint, written from SPEC 2.2 / 1.2 (not from our code).

    ``net`` container, ``module.`` prefix, ``layerN`` sequentials (0 = patch embedding, 2j+1 =
    attention block, 2j+2 = MLP block). Stages 1-2: long-short layers (fused qkv, proj,
    to_dynamic_projection (r*heads, C), dual_ln_dp, dual_ln_full, a 2(w+p-1)(2p+w+1)+1-row table
    with p = int(0.5 w), the (w^2, (w+2p)^2) index buffer; no global-token biases). Stages 3-4:
    ViL full attention (fused qkv, (2n-1)^2 tables, g2l/g2g where the stage has global tokens).
    """
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.02  # noqa: E731
    p = int(0.5 * window)
    ls_rows = 2 * (window + p - 1) * (2 * p + window + 1) + 1
    net, in_dim, side = {}, 3, img_size
    for i, (depth, dim, heads) in enumerate(zip(spec['depths'], spec['dims'], spec['heads'])):
        patch, num_global = (4, 2, 2, 2)[i], (1, 1, 1, 0)[i]
        side //= patch
        layer = f'module.layer{i + 1}'
        net[f'{layer}.0.proj.weight'] = rand(dim, in_dim, patch, patch)
        net[f'{layer}.0.proj.bias'] = rand(dim)
        net[f'{layer}.0.norm_embed.weight'], net[f'{layer}.0.norm_embed.bias'] = 1 + rand(dim), rand(dim)
        if num_global:
            net[f'{layer}.0.cls_token'] = rand(1, num_global, dim)
        for j in range(depth):
            attn, mlp = f'{layer}.{2 * j + 1}', f'{layer}.{2 * j + 2}'
            net[f'{attn}.norm.weight'], net[f'{attn}.norm.bias'] = 1 + rand(dim), rand(dim)
            net[f'{attn}.attn.qkv.weight'], net[f'{attn}.attn.qkv.bias'] = rand(3 * dim, dim), rand(3 * dim)
            net[f'{attn}.attn.proj.weight'], net[f'{attn}.attn.proj.bias'] = rand(dim, dim), rand(dim)
            if i < 2:
                net[f'{attn}.attn.to_dynamic_projection.weight'] = rand(rank * heads, dim)
                net[f'{attn}.attn.to_dynamic_projection.bias'] = rand(rank * heads)
                for ln in ('dual_ln_dp', 'dual_ln_full'):
                    net[f'{attn}.attn.{ln}.weight'], net[f'{attn}.attn.{ln}.bias'] = 1 + rand(dim), rand(dim)
                net[f'{attn}.attn.local_relative_position_bias_table'] = rand(ls_rows, heads)
                net[f'{attn}.attn.relative_position_index'] = torch.zeros(
                    window ** 2, (window + 2 * p) ** 2, dtype=torch.long)
            else:
                net[f'{attn}.attn.local_relative_position_bias_table'] = rand((2 * side - 1) ** 2, heads)
                net[f'{attn}.attn.relative_position_index'] = torch.zeros(side ** 2, side ** 2,
                                                                          dtype=torch.long)
                if num_global:
                    net[f'{attn}.attn.g2l_relative_position_bias'] = rand(2, heads, num_global)
                    net[f'{attn}.attn.g2g_relative_position_bias'] = rand(heads, num_global, num_global)
            net[f'{mlp}.norm.weight'], net[f'{mlp}.norm.bias'] = 1 + rand(dim), rand(dim)
            net[f'{mlp}.mlp.fc1.weight'], net[f'{mlp}.mlp.fc1.bias'] = rand(4 * dim, dim), rand(4 * dim)
            net[f'{mlp}.mlp.fc2.weight'], net[f'{mlp}.mlp.fc2.bias'] = rand(dim, 4 * dim), rand(dim)
        in_dim = dim
    last = spec['dims'][-1]
    net['module.norm.weight'], net['module.norm.bias'] = 1 + rand(last), rand(last)
    net['module.head.weight'], net['module.head.bias'] = rand(1000, last), rand(1000)
    return dict(net=net, arch='official', epoch=300, best_acc=83.8, optimizer={}, scheduler={})


@pytest.mark.parametrize('arch,expected_m', [('medium', 39.80), ('base', 55.83)])
def test_classification_parameter_counts(arch, expected_m):
    """SPEC 6: LS in stages 1-2, full attention in 3-4 at 224, 1000-class head."""
    model = Classifier(backbone_type='ViLLS', arch=arch, num_classes=1000, attn_types=CLS_LAYOUT)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(count - expected_m) / expected_m < 0.005, count


def test_default_layout_and_long_short_keys():
    model = ViLLS(arch=TINY_ARCH, window_size=7)
    kinds = [type(stage.blocks[0].attn) for stage in model.stages]
    assert kinds == [LongShortAttention] * 2 + [SlidingChunkAttention] * 2
    keys = {k.split('attn.', 1)[1] for k in model.state_dict() if k.startswith('stages.0.blocks.0.attn.')}
    assert keys == {f'{m}.{p}' for m in ('qkv', 'proj', 'to_dynamic_projection', 'dual_ln_dp', 'dual_ln_full')
                    for p in ('weight', 'bias')} | {'local_relative_position_bias_table'}
    attn = model.stages[1].blocks[0].attn
    assert attn.local_relative_position_bias_table.shape == (253, 2)
    assert attn.relative_position_index.shape == (49, 169)                    # a non-persistent buffer
    assert attn.to_dynamic_projection.weight.shape == (8 * 2, 32)            # r = 8 by default
    assert attn.dual_ln_dp.eps == attn.dual_ln_full.eps == 1e-5
    assert model.stages[0].blocks[0].norm1.eps == 1e-6
    w8 = ViLLS(arch=TINY_ARCH, window_size=8).stages[0].blocks[0].attn
    assert w8.local_relative_position_bias_table.shape == (375, 1)


@pytest.mark.parametrize('size', [(37, 53), (1, 1), (5, 300), (29, 19)])
def test_forward_backward_at_any_size(size):
    model = ViLLS(arch=TINY_ARCH, num_global_tokens=(1, 2, 1, 0)).train()
    x = torch.randn(2, 3, *size, requires_grad=True)
    outs = model(x)
    h, w = size
    for out, stride, dim in zip(outs, (4, 8, 16, 32), TINY_ARCH['embed_dims']):
        assert out.shape == (2, dim, -(-h // stride), -(-w // stride))
        assert torch.isfinite(out).all()
    sum(o.pow(2).mean() for o in outs).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert torch.isfinite(x.grad).all()


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    plain = ViLLS(arch=TINY_ARCH, drop_path_rate=0.0).train()
    ckpt = copy.deepcopy(plain)
    for stage in ckpt.stages:
        stage.with_cp = True
    x = torch.randn(1, 3, 45, 38, requires_grad=True)
    grads = [torch.autograd.grad(sum(o.pow(2).mean() for o in m(x)), list(m.parameters()))
             for m in (plain, ckpt)]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_official_checkpoint_loads_into_dense_backbone(tmp_path):
    path = tmp_path / 'vil_ls_medium_official.pth'
    torch.save(official_vil_ls_checkpoint(MEDIUM), path)
    model = ViLLS(arch='medium')
    report = load_pretrained(model, str(path))
    assert report.layout == 'vil_official' and report.container == 'net'
    assert report.missing == [] and report.unexpected == [] and report.mismatched == {}
    assert sorted(report.fresh) == [f'norm{i}.{p}' for i in range(3) for p in ('bias', 'weight')]
    assert set(report.resized) == {'stages.3.blocks.0.attn.local_relative_position_bias_table'}
    assert report.num_loaded_params == report.num_model_params - 6

    net = official_vil_ls_checkpoint(MEDIUM)['net']
    o = lambda key: net['module.' + key]  # noqa: E731
    sd = model.state_dict()
    for ours, official in [('stages.0.blocks.0.attn.qkv.weight', 'layer1.1.attn.qkv.weight'),
                           ('stages.1.blocks.3.attn.to_dynamic_projection.bias',
                            'layer2.7.attn.to_dynamic_projection.bias'),
                           ('stages.1.blocks.2.attn.dual_ln_dp.weight', 'layer2.5.attn.dual_ln_dp.weight'),
                           ('stages.1.blocks.2.attn.dual_ln_full.bias', 'layer2.5.attn.dual_ln_full.bias'),
                           ('stages.1.blocks.1.attn.local_relative_position_bias_table',
                            'layer2.3.attn.local_relative_position_bias_table'),
                           ('stages.1.blocks.1.norm2.weight', 'layer2.4.norm.weight'),
                           ('stages.2.blocks.7.attn.local_relative_position_bias_table',
                            'layer3.15.attn.local_relative_position_bias_table'),
                           ('norm3.weight', 'norm.weight')]:
        torch.testing.assert_close(sd[ours], o(official))
    qkv = o('layer3.5.attn.qkv.weight')
    torch.testing.assert_close(sd['stages.2.blocks.2.attn.query.weight'], qkv[:384])
    torch.testing.assert_close(sd['stages.2.blocks.2.attn.kv.weight'], qkv[384:])


def test_stages_one_and_two_are_the_classification_model():
    """The same official checkpoint in the classification layout loads 1:1 (nothing converted or
    resized) and gives the dense backbone's stage 1-2 outputs exactly."""
    checkpoint = official_vil_ls_checkpoint(LS_TINY)
    classification = ViLLS(arch='tiny', attn_types=CLS_LAYOUT).eval()
    report = load_pretrained(classification, checkpoint)
    assert report.missing == [] and report.unexpected == [] and report.resized == {}
    assert not any('.attn.' in k for k in report.converted)
    dense = ViLLS(arch='tiny').eval()
    load_pretrained(dense, checkpoint)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        for a, b in zip(classification(x)[:2], dense(x)[:2]):
            torch.testing.assert_close(a, b)


def test_window_table_of_another_size_is_an_error_not_a_resize():
    w8 = official_vil_ls_checkpoint(LS_TINY, window=8)
    with pytest.raises(ValueError, match='window_size=8'):
        load_pretrained(ViLLS(arch='tiny'), w8)
    model = ViLLS(arch=TINY_ARCH)
    sd = model.state_dict()
    sd['stages.0.blocks.0.attn.local_relative_position_bias_table'] = torch.zeros(375, 1)
    with pytest.raises(ValueError, match='cannot be resized'):
        model.load_state_dict(sd)
    # 121 rows (w=5) happens to be 11^2: still refused rather than resized as a grid.
    sd['stages.0.blocks.0.attn.local_relative_position_bias_table'] = torch.zeros(121, 1)
    with pytest.raises(ValueError, match='window_size=5'):
        model.load_state_dict(sd)


@pytest.mark.parametrize('scope', ['mmdet', 'mmseg'])
def test_registered_for_both_scopes(scope):
    registry = importlib.import_module(f'{scope}.registry').MODELS
    assert isinstance(registry.build(dict(type='ViLLS', arch=TINY_ARCH)), ViLLS)


def test_maskrcnn_config_builds():
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    cfg = Config.fromfile(ROOT / 'configs' / 'maskrcnn_vil_ls_m_1x.py')
    assert cfg.model.backbone.type == 'ViLLS' and cfg.model.backbone.arch == 'medium'
    detector = MODELS.build(cfg.model)
    backbone = detector.backbone
    assert [len(s.blocks) for s in backbone.stages] == [1, 4, 16, 1]
    assert isinstance(backbone.stages[1].blocks[0].attn, LongShortAttention)
    assert isinstance(backbone.stages[2].blocks[0].attn, SlidingChunkAttention)
    assert backbone.stages[-1].blocks[0].drop_path.drop_prob == pytest.approx(cfg.model.backbone.drop_path_rate)


@pytest.mark.parametrize('kwargs,match', [
    (dict(dp_rank=0), 'dp_rank'),
    (dict(dp_rank=(8, 8)), 'dp_rank'),
    (dict(attn_types='linear'), 'long_short'),
    (dict(arch='huge'), 'unknown arch'),
])
def test_bad_config_values_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ViLLS(**{'arch': TINY_ARCH, **kwargs})


def test_classifier_rejects_unknown_backbone_type():
    with pytest.raises(ValueError, match='backbone_type'):
        Classifier(backbone_type='Swin')
