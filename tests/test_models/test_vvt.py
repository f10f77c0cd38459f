"""VVT backbone: fidelity (parameter counts, official checkpoints, attention wiring), precision and memory.

The backbone contract (outputs, out_indices, frozen_stages, norm_eval, with_cp, drop path,
init_cfg) is tested for every backbone in tests/test_models/test_backbone_contract.py.
"""

import pytest
import torch

import visattn_mm  # noqa: F401  (registration)
from helpers import VVT_TINY_ARCH as TINY_ARCH
from helpers import build_config_model_on_meta
from paths import ROOT
from visattn_mm.checkpoint import load_pretrained
from visattn_mm.models import Classifier, VVT
from visattn_mm.models.vvt import VicinityAttention
from visattn_mm.ops.vicinity import signed_clamp
from visattn_mm.ops.vicinity.reference import vicinity_attention_dense

VVT_T = dict(depths=(2, 2, 2, 2), dims=(96, 160, 320, 512), heads=(1, 2, 5, 8), mlp=(8, 8, 4, 4))


@pytest.mark.parametrize('arch,expected_m', [('tiny', 12.88), ('small', 25.49), ('medium', 47.91), ('large', 61.85)])
def test_classification_parameter_counts(arch, expected_m):
    """VVT paper, Table 2: backbone (with all four stage norms) + mean-pooled last stage + 1000-class head.

    Built on the meta device: same module tree, no initialisation cost.
    """
    with torch.device('meta'):
        model = Classifier(backbone_type='VVT', arch=arch, num_classes=1000)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(count - expected_m) / expected_m < 0.005, count


def test_upernet_config_parameter_count_and_maskrcnn_config_build():
    """Paper (Table 5): UperNet VVT-S 55.5M; the Mask R-CNN config builds with a VVT-S backbone."""
    for name in ('_base_/upernet_160k_ade20k.py', 'upernet_vvt_s_160k_ade20k.py', 'maskrcnn_vvt_s_1x.py'):
        assert 'default_scope' not in (ROOT / 'configs' / name).read_text()
    cfg, segmentor, count = build_config_model_on_meta('upernet_vvt_s_160k_ade20k.py')
    assert cfg.model.backbone.type == 'VVT' and 'norm_cfg' not in cfg.model.backbone
    assert cfg.model.decode_head.norm_cfg.type == 'BN' and cfg.model.auxiliary_head.norm_cfg.type == 'BN'
    assert cfg.model.data_preprocessor.test_cfg == dict(size_divisor=32)
    assert cfg.default_scope == 'mmseg'  # from mmseg's runtime base; our configs never set it
    assert isinstance(segmentor.backbone, VVT)
    assert abs(count - 55.5) / 55.5 < 0.02, count

    cfg, detector, _ = build_config_model_on_meta('maskrcnn_vvt_s_1x.py')
    assert cfg.default_scope == 'mmdet'
    assert isinstance(detector.backbone, VVT) and detector.backbone.embed_dims == (96, 160, 320, 512)
    assert [c.conv.in_channels for c in detector.neck.lateral_convs] == [96, 160, 320, 512]


def official_vvt_checkpoint(spec, seed=0, container=True, num_classes=1000):
    """An official VVT classification checkpoint, written from the official layout (not from our code).

    The layout (docs/backbones.md#official-checkpoint-layouts): ``patch_embed{i}.proj`` (7x7
    then 3x3 convs) / ``.norm``; ``block{i}.{j}.norm1``, ``attn.{q,k,v}_proj`` Linear(C, C/2),
    ``attn.out_proj`` Linear(C/2, C), ``attn.se_fc.0`` / ``.2`` Linear(C, C) without bias,
    ``norm2``, ``mlp.fc1``, ``mlp.dwconv.dwconv`` (depthwise 3x3), ``mlp.fc2``; ``norm{i}``; ``head``.
    """
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.02  # noqa: E731
    sd, in_dim = {}, 3
    for i, (depth, dim, mlp) in enumerate(zip(spec['depths'], spec['dims'], spec['mlp']), start=1):
        kernel = 7 if i == 1 else 3
        sd[f'patch_embed{i}.proj.weight'] = rand(dim, in_dim, kernel, kernel)
        sd[f'patch_embed{i}.proj.bias'] = rand(dim)
        sd[f'patch_embed{i}.norm.weight'], sd[f'patch_embed{i}.norm.bias'] = 1 + rand(dim), rand(dim)
        for j in range(depth):
            p = f'block{i}.{j}'
            hidden = dim * mlp
            for norm in ('norm1', 'norm2'):
                sd[f'{p}.{norm}.weight'], sd[f'{p}.{norm}.bias'] = 1 + rand(dim), rand(dim)
            for name in ('q_proj', 'k_proj', 'v_proj'):
                sd[f'{p}.attn.{name}.weight'], sd[f'{p}.attn.{name}.bias'] = rand(dim // 2, dim), rand(dim // 2)
            sd[f'{p}.attn.out_proj.weight'], sd[f'{p}.attn.out_proj.bias'] = rand(dim, dim // 2), rand(dim)
            sd[f'{p}.attn.se_fc.0.weight'], sd[f'{p}.attn.se_fc.2.weight'] = rand(dim, dim), rand(dim, dim)
            sd[f'{p}.mlp.fc1.weight'], sd[f'{p}.mlp.fc1.bias'] = rand(hidden, dim), rand(hidden)
            sd[f'{p}.mlp.dwconv.dwconv.weight'] = rand(hidden, 1, 3, 3)
            sd[f'{p}.mlp.dwconv.dwconv.bias'] = rand(hidden)
            sd[f'{p}.mlp.fc2.weight'], sd[f'{p}.mlp.fc2.bias'] = rand(dim, hidden), rand(dim)
        sd[f'norm{i}.weight'], sd[f'norm{i}.bias'] = 1 + rand(dim), rand(dim)
        in_dim = dim
    sd['head.weight'], sd['head.bias'] = rand(num_classes, in_dim), rand(num_classes)
    if not container:
        return sd
    return dict(model=sd, optimizer={}, lr_scheduler={}, epoch=299, scaler={}, args=dict(model='vvt_tiny'))


@pytest.fixture(scope='module')
def vvt_tiny():
    return VVT(arch='tiny')


@pytest.mark.parametrize('container', [True, False])
def test_official_checkpoint_loads_completely(vvt_tiny, container):
    checkpoint = official_vvt_checkpoint(VVT_T, seed=int(container), container=container)
    report = load_pretrained(vvt_tiny, checkpoint)
    assert report.container == ('model' if container else 'bare')
    assert report.layout == 'vvt_official'
    assert report.missing == [] and report.unexpected == [] and report.mismatched == {}
    assert report.dropped == {'head.weight': 'classification head', 'head.bias': 'classification head'}
    assert report.num_loaded_params == report.num_model_params == len(list(vvt_tiny.parameters()))
    sd = checkpoint['model'] if container else checkpoint
    own = vvt_tiny.state_dict()
    assert set(report.renamed) == set(own) and set(report.renamed.values()) == set(sd) - {'head.weight', 'head.bias'}
    for key, official in (
        ('stages.0.patch_embed.proj.weight', 'patch_embed1.proj.weight'),
        ('stages.2.blocks.1.attn.se_fc.2.weight', 'block3.1.attn.se_fc.2.weight'),
        ('stages.1.blocks.0.mlp.dwconv.dwconv.weight', 'block2.0.mlp.dwconv.dwconv.weight'),
        ('stages.3.blocks.1.attn.out_proj.bias', 'block4.1.attn.out_proj.bias'),
        ('stages.3.norm.weight', 'norm4.weight'),
    ):
        assert report.renamed[key] == official
        assert torch.equal(own[key], sd[official]), key


def test_official_checkpoint_through_init_cfg_and_truncated_stages(tmp_path):
    spec = dict(depths=(1, 1, 1, 1), dims=(8, 16, 16, 16), heads=(1, 2, 2, 4), mlp=(2, 2, 2, 2))
    checkpoint = official_vvt_checkpoint(spec)
    checkpoint['model'] = {f'module.{k}': v for k, v in checkpoint['model'].items()}  # DataParallel
    path = tmp_path / 'vvt_official.pth'
    torch.save(checkpoint, path)
    model = VVT(arch=TINY_ARCH, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    model.init_weights()
    torch.testing.assert_close(
        model.stages[1].blocks[0].attn.q_proj.weight, checkpoint['model']['module.block2.0.attn.q_proj.weight']
    )

    # out_indices stop at stage 3: stage 4 is not built and its tensors are dropped with a reason.
    short = VVT(arch=TINY_ARCH, out_indices=(1, 2))
    report = load_pretrained(short, str(path))
    assert len(short.stages) == 3 and report.missing == [] and report.unexpected == []
    dropped = {report.renamed[k] for k, why in report.dropped.items() if why.startswith('stage not built')}
    assert dropped == {
        k[len('module.') :]
        for k in checkpoint['model']
        if k.startswith(('module.patch_embed4.', 'module.block4.', 'module.norm4.'))
    }
    assert len(dropped) == 4 + 20 + 2  # patch embedding, one block, norm4


def test_checkpoint_of_another_size_is_refused():
    with torch.device('meta'):
        small = VVT(arch='small')
    with pytest.raises(ValueError, match='refusing to load'):
        load_pretrained(small, official_vvt_checkpoint(VVT_T))


def _module_reference(attn, x, hw):
    """The attention layer written out: per-head channel slices, quadratic vicinity attention,
    out_proj + clamp, gate from the mean of the layer's input, clamp."""
    heads = attn.num_heads
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    d = q.shape[-1] // heads
    outs = [
        vicinity_attention_dense(
            q[..., h * d : (h + 1) * d], k[..., h * d : (h + 1) * d], v[..., h * d : (h + 1) * d], *hw
        )
        for h in range(heads)
    ]
    out = signed_clamp(attn.out_proj(torch.cat(outs, dim=-1)))
    gate = torch.sigmoid(attn.se_fc[2](torch.relu(attn.se_fc[0](x.mean(dim=1)))))
    return signed_clamp(out + out * gate[:, None])


@pytest.mark.parametrize('hw', [(3, 5), (4, 4), (1, 7)])
def test_attention_layer_matches_quadratic_reference(hw):
    torch.manual_seed(0)
    attn = VicinityAttention(20, num_heads=2).double().eval()
    x = torch.randn(2, hw[0] * hw[1], 20, dtype=torch.float64)
    torch.testing.assert_close(attn(x, hw), _module_reference(attn, x, hw), rtol=1e-5, atol=1e-6)


def test_attention_layer_clamps_after_out_proj_and_gate():
    attn = VicinityAttention(8, num_heads=1).double().eval()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    gate = torch.sigmoid(attn.se_fc[2](torch.relu(attn.se_fc[0](x.mean(dim=1)))))
    with torch.no_grad():
        attn.out_proj.weight.zero_()
        attn.out_proj.bias.fill_(1e6)  # out_proj -> 1e6 -> 1e4; gated 1e4 (1 + s) -> 1e4
        assert torch.equal(attn(x, (2, 3)), torch.full((1, 6, 8), 1e4, dtype=torch.float64))
        attn.out_proj.bias.fill_(1e-7)  # out_proj -> 1e-7 -> 1e-4; gated 1e-4 (1 + s), in range
        torch.testing.assert_close(attn(x, (2, 3)), (1e-4 * (1 + gate))[:, None].expand(1, 6, 8))


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_half_precision_autocast_backward_is_finite(dtype):
    torch.manual_seed(0)
    model = VVT(arch=TINY_ARCH).train()
    with torch.autocast('cpu', dtype=dtype):
        outs = model(torch.randn(2, 3, 96, 160) * 50)
        loss = sum(o.float().pow(2).mean() for o in outs)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_backbone_memory_is_linear_in_pixels():
    """Forward + backward of the whole backbone: the largest tensor grows with the pixel count."""
    from helpers import OpRecorder

    model = VVT(arch=TINY_ARCH, drop_path_rate=0.0)
    peaks = []
    for side in (64, 128):
        recorder = OpRecorder()
        with recorder:
            sum(o.sum() for o in model(torch.randn(1, 3, side, side))).backward()
        peaks.append(recorder.max_numel)
        tokens = (side // 4) ** 2
        assert recorder.max_numel < tokens**2, (side, recorder.max_numel)
    assert peaks[1] / peaks[0] == pytest.approx(4, rel=0.05)
