"""ImageNet checkpoints into dense backbones: official ViL layout, resizing, reports, refusals."""

import argparse
import math
import subprocess
import sys

import pytest
import torch
from mmengine.config import Config

import visattn_mm  # noqa: F401
from helpers import VIL_TINY_ARCH as TINY_ARCH
from helpers import assert_unchanged, official_vil_checkpoint, snapshot
from paths import ROOT
from visattn_mm.checkpoint import load_pretrained, read_checkpoint, unwrap_state_dict
from visattn_mm.models import Classifier, ViL
from visattn_mm.ops.rel_pos import resize_rpb_grid, resize_rpb_table

SMALL = dict(depths=(1, 2, 8, 1), dims=(96, 192, 384, 768), heads=(3, 3, 6, 12))
TINY = dict(depths=(1, 1, 9, 1), dims=(48, 96, 192, 384), heads=(1, 3, 3, 6))


def bilinear_reference(grid, size):
    """align_corners=False bilinear resize of a 2-D grid, written out with loops."""
    n = grid.shape[0]
    scale = n / size
    out = torch.zeros(size, size, dtype=torch.float64)

    def taps(dst):
        src = max((dst + 0.5) * scale - 0.5, 0.0)
        lo = min(int(math.floor(src)), n - 1)
        return lo, min(lo + 1, n - 1), src - lo

    for y in range(size):
        y0, y1, wy = taps(y)
        for x in range(size):
            x0, x1, wx = taps(x)
            out[y, x] = (
                (1 - wy) * (1 - wx) * grid[y0, x0]
                + (1 - wy) * wx * grid[y0, x1]
                + wy * (1 - wx) * grid[y1, x0]
                + wy * wx * grid[y1, x1]
            )
    return out


def test_resize_rpb_table_hand_computed():
    # One head, 2x2 offsets [[0, 1], [2, 3]] -> 3x3: sources at 0, 0.5 and 1 (clamped) per axis.
    table = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    expected = torch.tensor([0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 2.5, 3.0])[:, None]
    torch.testing.assert_close(resize_rpb_table(table, 9), expected)
    assert resize_rpb_table(table, 4) is table
    with pytest.raises(ValueError, match='square'):
        resize_rpb_table(torch.zeros(253, 3), 729)  # Transformer-LS' aliased table has no grid


def test_resize_rpb_grid_rectangular_hand_computed():
    # One head, 2x3 offsets [[0, 1, 2], [3, 4, 5]] -> 3x3: rows from sources 0, 0.5, 1; columns kept.
    table = torch.arange(6.0)[:, None]
    expected = torch.tensor([0.0, 1.0, 2.0, 1.5, 2.5, 3.5, 3.0, 4.0, 5.0])[:, None]
    torch.testing.assert_close(resize_rpb_grid(table, (2, 3), (3, 3)), expected)
    assert resize_rpb_grid(table, (2, 3), (2, 3)) is table


@pytest.fixture(scope='module')
def official_small(tmp_path_factory):
    path = tmp_path_factory.mktemp('ckpt') / 'vil_small_official.pth'
    torch.save(official_vil_checkpoint(SMALL), path)
    return path


def _build_maskrcnn_vil_s(checkpoint):
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope

    init_default_scope('mmdet')
    cfg = Config.fromfile(ROOT / 'configs' / 'maskrcnn_vil_s_1x.py')
    cfg.model.backbone.init_cfg = dict(type='Pretrained', checkpoint=str(checkpoint))
    return MODELS.build(cfg.model)


def test_official_vil_checkpoint_into_maskrcnn_config(official_small):
    detector = _build_maskrcnn_vil_s(official_small)
    detector.init_weights()
    backbone = detector.backbone
    net = official_vil_checkpoint(SMALL)['net']
    o = lambda key: net['module.' + key]  # noqa: E731

    # Report of the same load: nothing missing or unexpected; output norms 0-2 are new.
    report = load_pretrained(ViL(arch='small'), str(official_small))
    assert report.layout == 'vil_official' and report.container == 'net'
    assert report.missing == [] and report.unexpected == [] and report.mismatched == {}
    assert sorted(report.fresh) == [f'norm{i}.{p}' for i in range(3) for p in ('bias', 'weight')]
    assert set(report.resized) == {'stages.3.blocks.0.attn.local_relative_position_bias_table'}
    assert report.num_loaded_params == report.num_model_params - 6

    # Spot checks against the official recipe.
    sd = backbone.state_dict()
    torch.testing.assert_close(sd['stages.0.patch_embed.proj.weight'], o('layer1.0.proj.weight'))
    torch.testing.assert_close(sd['stages.1.blocks.1.norm2.weight'], o('layer2.4.norm.weight'))
    torch.testing.assert_close(sd['stages.0.blocks.0.attn.kv.weight'], o('layer1.1.attn.kv.weight'))
    qkv = o('layer3.5.attn.qkv.weight')
    torch.testing.assert_close(sd['stages.2.blocks.2.attn.query.weight'], qkv[:384])
    torch.testing.assert_close(sd['stages.2.blocks.2.attn.kv.weight'], qkv[384:])
    torch.testing.assert_close(sd['stages.2.blocks.2.attn.kv.bias'], o('layer3.5.attn.qkv.bias')[384:])
    torch.testing.assert_close(sd['stages.2.patch_embed.cls_token'], o('layer3.0.cls_token'))
    # Stage 3 table: 27x27 (14x14 map) == the w=7 chunk table, loaded unchanged.
    torch.testing.assert_close(
        sd['stages.2.blocks.7.attn.local_relative_position_bias_table'],
        o('layer3.15.attn.local_relative_position_bias_table'),
    )
    # Stage 4 table: 13x13 (7x7 map) -> 27x27, against an independent bilinear computation.
    old = o('layer4.1.attn.local_relative_position_bias_table')
    new = sd['stages.3.blocks.0.attn.local_relative_position_bias_table']
    for head in (0, 11):
        expected = bilinear_reference(old[:, head].reshape(13, 13).double(), 27).reshape(-1)
        torch.testing.assert_close(new[:, head].double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sd['norm3.weight'], o('norm.weight'))


def test_global_token_count_is_adapted():
    model = ViL(arch='small', num_global_tokens=(2, 2, 3, 0))
    report = load_pretrained(model, official_vil_checkpoint(SMALL))
    net = official_vil_checkpoint(SMALL)['net']
    token = net['module.layer3.0.cls_token']
    torch.testing.assert_close(model.stages[2].patch_embed.cls_token, token.expand(1, 3, 384))
    g2g = model.stages[2].blocks[0].attn.g2g_relative_position_bias
    assert g2g.shape == (6, 3, 3)
    assert 'stages.2.patch_embed.cls_token' in report.resized


@pytest.mark.parametrize('make', ['resnet', 'vil_tiny'])
def test_wrong_model_is_refused_and_nothing_loads(tmp_path, make):
    if make == 'resnet':
        import torchvision

        checkpoint = {'state_dict': torchvision.models.resnet50().state_dict()}
    else:
        checkpoint = official_vil_checkpoint(TINY)
    model = ViL(arch='small')
    before = snapshot(model)
    with pytest.raises(ValueError, match='refusing to load') as err:
        load_pretrained(model, checkpoint)
    assert 'layout' in str(err.value) and 'allow_partial' in str(err.value)
    assert_unchanged(model, before)


def test_allow_partial_loads_on_purpose():
    model = ViL(arch='small')
    report = load_pretrained(model, official_vil_checkpoint(TINY), allow_partial=True)
    assert report.loaded_fraction < 0.9 and report.mismatched


def test_classifier_checkpoint_round_trips_into_dense_backbone(tmp_path):
    torch.manual_seed(0)
    classifier = Classifier(arch=TINY_ARCH, num_classes=10)
    path = tmp_path / 'cls.pth'
    torch.save({'state_dict': classifier.state_dict()}, path)
    dense = ViL(arch=TINY_ARCH)
    report = load_pretrained(dense, str(path))
    assert report.container == 'state_dict+backbone.'
    assert report.missing == [] and report.unexpected == []
    for key, value in classifier.backbone.state_dict().items():
        torch.testing.assert_close(dense.state_dict()[key], value)


def test_plain_load_state_dict_resizes_tables():
    """The pre-hook serves every load path, not only init_cfg."""
    model = ViL(arch=TINY_ARCH, window_size=3)
    sd = model.state_dict()
    key = 'stages.0.blocks.0.attn.local_relative_position_bias_table'
    sd[key] = torch.randn(5 * 5, 1)  # e.g. from a window-2 model
    sd['stages.0.blocks.0.attn.relative_position_index'] = torch.zeros(3, dtype=torch.long)
    model.load_state_dict(sd, strict=True)
    assert model.state_dict()[key].shape == (121, 1)


def test_non_weights_only_checkpoint_falls_back_with_a_warning(tmp_path):
    path = tmp_path / 'with_args.pth'
    torch.save({'model': ViL(arch=TINY_ARCH).state_dict(), 'args': argparse.Namespace(lr=1e-3)}, path)
    with pytest.warns(UserWarning, match='weights_only=True'):
        checkpoint = read_checkpoint(path)
    assert unwrap_state_dict(checkpoint)[1] == 'model'


def test_convert_tool_writes_weights_only_file(tmp_path, official_small):
    out = tmp_path / 'checkpoints' / 'converted.pth'  # a folder that does not exist yet
    proc = subprocess.run(
        [
            sys.executable,
            'tools/convert_ckpt.py',
            str(official_small),
            str(out),
            '--config',
            'configs/maskrcnn_vil_s_1x.py',
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'vil_official' in proc.stdout and 'missing: 0' in proc.stdout
    converted = torch.load(out, weights_only=True)
    assert converted['meta']['layout'] == 'vil_official'
    report = load_pretrained(ViL(arch='small'), str(out))
    assert report.layout == 'ours' and report.missing == [] and report.resized == {}


def test_ape_tables_are_interpolated_in_1d():
    """APE models trained at another size: x/y tables are linearly resized on load."""
    source = ViL(arch=TINY_ARCH, use_rpb=False, pretrain_img_size=64)  # stage 1: 16 x 16
    target = ViL(arch=TINY_ARCH, use_rpb=False, pretrain_img_size=96)  # stage 1: 24 x 24
    report = load_pretrained(target, source.state_dict())
    key = 'stages.0.patch_embed.x_pos_embed'
    assert report.resized[key] == ((1, 16, 8), (1, 24, 8))
    expected = torch.nn.functional.interpolate(
        source.state_dict()[key].transpose(1, 2), size=24, mode='linear', align_corners=False
    ).transpose(1, 2)
    torch.testing.assert_close(target.state_dict()[key], expected)


def test_convert_tool_refusal_names_its_own_flag(tmp_path, monkeypatch):
    """The refusal named init_cfg's allow_partial=True, which the tool's command line cannot pass."""
    from tool_runs import _load_tool

    source = tmp_path / 'resnet.pth'
    torch.save({'conv1.weight': torch.randn(64, 3, 7, 7), 'fc.weight': torch.randn(1000, 2048)}, source)
    monkeypatch.setattr(
        sys, 'argv', ['convert_ckpt.py', str(source), str(tmp_path / 'out.pth'), '--backbone', 'type=ViL', 'arch=tiny']
    )
    with pytest.raises(SystemExit, match='refusing to load') as err:
        _load_tool('convert_ckpt').main()
    assert 'Pass --allow-partial' in str(err.value) and 'allow_partial=True' not in str(err.value)
    assert not (tmp_path / 'out.pth').exists()
