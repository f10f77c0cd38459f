"""ViL-LS (Transformer-LS) backbone: fidelity, official checkpoints, attention layout.

The backbone contract (outputs, out_indices, frozen_stages, norm_eval, with_cp, drop path,
init_cfg) is tested for every backbone in tests/test_models/test_backbone_contract.py.
"""

import pytest
import torch
from mmengine.config import Config

import visattn_mm  # noqa: F401
from helpers import VIL_TINY_ARCH as TINY_ARCH
from helpers import official_vil_layout_checkpoint
from paths import ROOT
from visattn_mm.checkpoint import load_pretrained
from visattn_mm.models import Classifier, ViLLS
from visattn_mm.models.vil_attention import LongShortAttention, SlidingChunkAttention

CLS_LAYOUT = ('long_short', 'long_short', 'full', 'full')
MEDIUM = dict(depths=(1, 4, 16, 1), dims=(96, 192, 384, 768), heads=(3, 3, 6, 12))
LS_TINY = dict(depths=(1, 1, 9, 1), dims=(48, 96, 192, 384), heads=(1, 3, 3, 6))


def official_vil_ls_checkpoint(spec, seed=0, img_size=224, window=7, rank=8):
    """An official ViL-LS classification checkpoint (see :func:`official_vil_layout_checkpoint`).

    Stages 1-2: long-short layers (fused qkv, proj, to_dynamic_projection (r*heads, C),
    dual_ln_dp, dual_ln_full, a 2(w+p-1)(2p+w+1)+1-row table with p = int(0.5 w), the
    (w^2, (w+2p)^2) index buffer; no global-token biases).
    """
    p = int(0.5 * window)
    ls_rows = 2 * (window + p - 1) * (2 * p + window + 1) + 1

    def long_short_keys(net, attn, dim, heads, num_global, rand):
        net[f'{attn}.attn.qkv.weight'], net[f'{attn}.attn.qkv.bias'] = rand(3 * dim, dim), rand(3 * dim)
        net[f'{attn}.attn.proj.weight'], net[f'{attn}.attn.proj.bias'] = rand(dim, dim), rand(dim)
        net[f'{attn}.attn.to_dynamic_projection.weight'] = rand(rank * heads, dim)
        net[f'{attn}.attn.to_dynamic_projection.bias'] = rand(rank * heads)
        for ln in ('dual_ln_dp', 'dual_ln_full'):
            net[f'{attn}.attn.{ln}.weight'], net[f'{attn}.attn.{ln}.bias'] = 1 + rand(dim), rand(dim)
        net[f'{attn}.attn.local_relative_position_bias_table'] = rand(ls_rows, heads)
        net[f'{attn}.attn.relative_position_index'] = torch.zeros(window**2, (window + 2 * p) ** 2, dtype=torch.long)

    return official_vil_layout_checkpoint(spec, long_short_keys, seed, img_size, best_acc=83.8)


@pytest.mark.parametrize('arch,expected_m', [('medium', 39.80), ('base', 55.83)])
def test_classification_parameter_counts(arch, expected_m):
    """Transformer-LS paper, Table 5: LS in stages 1-2, full attention in 3-4 at 224, 1000-class head."""
    model = Classifier(backbone_type='ViLLS', arch=arch, num_classes=1000, attn_types=CLS_LAYOUT)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(count - expected_m) / expected_m < 0.005, count


def test_default_layout_and_long_short_keys():
    model = ViLLS(arch=TINY_ARCH, window_size=7)
    kinds = [type(stage.blocks[0].attn) for stage in model.stages]
    assert kinds == [LongShortAttention] * 2 + [SlidingChunkAttention] * 2
    keys = {k.split('attn.', 1)[1] for k in model.state_dict() if k.startswith('stages.0.blocks.0.attn.')}
    assert keys == {
        f'{m}.{p}'
        for m in ('qkv', 'proj', 'to_dynamic_projection', 'dual_ln_dp', 'dual_ln_full')
        for p in ('weight', 'bias')
    } | {'local_relative_position_bias_table'}
    attn = model.stages[1].blocks[0].attn
    assert attn.local_relative_position_bias_table.shape == (253, 2)
    assert attn.relative_position_index.shape == (49, 169)  # a non-persistent buffer
    assert attn.to_dynamic_projection.weight.shape == (8 * 2, 32)  # r = 8 by default
    assert attn.dual_ln_dp.eps == attn.dual_ln_full.eps == 1e-5
    assert model.stages[0].blocks[0].norm1.eps == 1e-6
    w8 = ViLLS(arch=TINY_ARCH, window_size=8).stages[0].blocks[0].attn
    assert w8.local_relative_position_bias_table.shape == (375, 1)


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
    for ours, official in [
        ('stages.0.blocks.0.attn.qkv.weight', 'layer1.1.attn.qkv.weight'),
        ('stages.1.blocks.3.attn.to_dynamic_projection.bias', 'layer2.7.attn.to_dynamic_projection.bias'),
        ('stages.1.blocks.2.attn.dual_ln_dp.weight', 'layer2.5.attn.dual_ln_dp.weight'),
        ('stages.1.blocks.2.attn.dual_ln_full.bias', 'layer2.5.attn.dual_ln_full.bias'),
        (
            'stages.1.blocks.1.attn.local_relative_position_bias_table',
            'layer2.3.attn.local_relative_position_bias_table',
        ),
        ('stages.1.blocks.1.norm2.weight', 'layer2.4.norm.weight'),
        (
            'stages.2.blocks.7.attn.local_relative_position_bias_table',
            'layer3.15.attn.local_relative_position_bias_table',
        ),
        ('norm3.weight', 'norm.weight'),
    ]:
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


def test_classifier_rejects_unknown_backbone_type():
    with pytest.raises(ValueError, match='backbone_type'):
        Classifier(backbone_type='Swin')
