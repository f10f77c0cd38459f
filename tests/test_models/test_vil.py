"""ViL backbone: fidelity (parameter counts, attention vs dense), random shift, absolute position embeddings.

The backbone contract (outputs, out_indices, frozen_stages, norm_eval, with_cp, drop path,
init_cfg) is tested for every backbone in tests/test_models/test_backbone_contract.py.
"""

import copy

import pytest
import torch

from helpers import VIL_TINY_ARCH as TINY_ARCH
from helpers import assert_same_gradients
from visattn_mm.models import Classifier, ViL, ViLLS, set_random_shift
from visattn_mm.models.vil_attention import FullAttention, SlidingChunkAttention
from visattn_mm.ops.common import dense_attention
from visattn_mm.ops.rel_pos import cached_full_attention_rpb_index, full_attention_rpb_index, resize_rpb_grid
from visattn_mm.ops.sliding_chunk.reference import sliding_chunk_attention_dense


@pytest.mark.parametrize('arch,expected_m', [('tiny', 6.72), ('small', 24.66), ('medium', 39.78), ('base', 55.80)])
def test_classification_parameter_counts(arch, expected_m):
    """ViL paper, Table 4: official classification layout (full attention in stages 3-4 at 224) + 1000-class head.

    The two decimals: docs/backbones.md#parameter-counts-to-two-decimals.
    """
    model = Classifier(arch=arch, num_classes=1000, attn_types=('sliding_chunk',) * 2 + ('full',) * 2)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(count - expected_m) / expected_m < 0.005, count


def _dense_module_reference(attn, x, hw):
    """The whole attention layer densely: local queries by the dense sliding-chunk reference,
    global queries over all keys with the global-token biases."""
    g, heads = attn.num_global, attn.num_heads
    b, n, c = x.shape
    q = (attn.query(x) * attn.scale).reshape(b, n, heads, -1).transpose(1, 2)
    k, v = attn.kv(x).reshape(b, n, 2, heads, -1).permute(2, 0, 3, 1, 4)
    g2l, g2g = attn.g2l_relative_position_bias, attn.g2g_relative_position_bias
    local = sliding_chunk_attention_dense(
        q[:, :, g:],
        k[:, :, g:],
        v[:, :, g:],
        *hw,
        attn.window,
        global_k=k[:, :, :g],
        global_v=v[:, :, :g],
        table=attn.local_relative_position_bias_table,
        l2g_bias=g2l[1],
        masking_mode=attn.masking_mode,
        shift_mode=attn.shift_mode,
    )
    glob = dense_attention(q[:, :, :g], k, v, torch.cat([g2g, g2l[0][..., None].expand(heads, g, n - g)], -1))
    out = torch.cat([glob, local], 2).transpose(1, 2).reshape(b, n, c)
    return attn.proj(out)


@pytest.mark.parametrize('hw', [(7, 7), (9, 13), (3, 2)])
@pytest.mark.parametrize('masking_mode,shift_mode', [(0, 0), (1, 0), (0, -1), (0, 6)])
def test_attention_layer_matches_dense(hw, masking_mode, shift_mode):
    torch.manual_seed(0)
    attn = (
        SlidingChunkAttention(8, 2, window=3, num_global=2, masking_mode=masking_mode, shift_mode=shift_mode)
        .double()
        .eval()
    )
    x = torch.randn(2, 2 + hw[0] * hw[1], 8, dtype=torch.float64)
    torch.testing.assert_close(attn(x, hw), _dense_module_reference(attn, x, hw), rtol=1e-5, atol=1e-5)


def test_full_attention_equals_sliding_chunk_when_chunk_covers_map():
    """A 3x3 map in one w=3 chunk: sliding chunk sees every key, exactly like full attention,
    and the (4w-1)^2 = 11^2 table indexes offsets like a 5x5 full table would, shifted by 3."""
    torch.manual_seed(0)
    sc = SlidingChunkAttention(8, 2, window=3, num_global=1).double().eval()
    full = FullAttention(8, 2, rpb_size=(3, 3), num_global=1).double().eval()
    with torch.no_grad():
        full.qkv.weight.copy_(torch.cat([sc.query.weight, sc.kv.weight]))
        full.qkv.bias.copy_(torch.cat([sc.query.bias, sc.kv.bias]))
        full.proj.load_state_dict(sc.proj.state_dict())
        full.g2l_relative_position_bias.copy_(sc.g2l_relative_position_bias)
        full.g2g_relative_position_bias.copy_(sc.g2g_relative_position_bias)
        table = sc.local_relative_position_bias_table.reshape(11, 11, 2)
        full.local_relative_position_bias_table.copy_(table[3:8, 3:8].reshape(25, 2))
    x = torch.randn(2, 10, 8, dtype=torch.float64)
    torch.testing.assert_close(full(x, (3, 3)), sc(x, (3, 3)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('hw', [(4, 4), (2, 5)])
def test_full_attention_at_another_size_uses_the_resized_table(hw):
    """A map of another size sees the table bilinearly resized to its offset grid: the same
    output as a layer built for that size holding the resized table; the gradient reaches it."""
    torch.manual_seed(0)
    full = FullAttention(8, 2, rpb_size=(3, 3), num_global=1).double()
    sized = FullAttention(8, 2, rpb_size=hw, num_global=1).double()
    state = full.state_dict()
    state['local_relative_position_bias_table'] = resize_rpb_grid(
        state['local_relative_position_bias_table'], (5, 5), (2 * hw[0] - 1, 2 * hw[1] - 1)
    )
    sized.load_state_dict(state)
    x = torch.randn(2, 1 + hw[0] * hw[1], 8, dtype=torch.float64)
    out = full(x, hw)
    torch.testing.assert_close(out, sized(x, hw), rtol=1e-12, atol=1e-12)
    out.sum().backward()
    assert full.local_relative_position_bias_table.grad.abs().sum() > 0


def test_output_shapes_at_detection_size():
    model = ViL(arch='tiny').eval()
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 800, 1216))
    assert [tuple(o.shape) for o in outs] == [(1, 48, 200, 304), (1, 96, 100, 152), (1, 192, 50, 76), (1, 384, 25, 38)]


def test_random_shift_draws_in_training_and_uses_mode_zero_in_eval():
    torch.manual_seed(0)
    model = ViL(arch=TINY_ARCH, random_shift=True, drop_path_rate=0.0)
    reference = copy.deepcopy(model)
    assert set_random_shift(reference, False) == 4
    x = torch.randn(1, 3, 64, 64)
    model.eval(), reference.eval()
    with torch.no_grad():
        for a, b in zip(model(x), reference(x)):
            torch.testing.assert_close(a, b)
    model.train()
    attn = model.stages[0].blocks[0].attn
    draws = {attn.resolve_shift_mode() for _ in range(200)}
    assert draws == set(range(1, 9))


def test_checkpointing_reuses_the_random_shift_draw():
    """with_cp recomputes the forward pass in backward: it must see the same neighbour chunk."""
    torch.manual_seed(0)
    plain = ViL(arch=TINY_ARCH, random_shift=True, drop_path_rate=0.0).train()
    ckpt = copy.deepcopy(plain)
    for stage in ckpt.stages:
        stage.with_cp = True
    assert_same_gradients(plain, ckpt, torch.randn(1, 3, 64, 64, requires_grad=True), seed=123)


def test_absolute_position_embedding_variant_runs_at_any_size():
    model = ViL(arch=TINY_ARCH, use_rpb=False, pretrain_img_size=64).eval()
    assert model.stages[0].patch_embed.x_pos_embed.shape == (1, 16, 8)
    assert not hasattr(model.stages[0].blocks[0].attn, 'local_relative_position_bias_table')
    with torch.no_grad():
        outs = model(torch.randn(1, 3, 45, 70))
    assert outs[0].shape == (1, 16, 12, 18)


def test_full_attention_index_of_another_size_is_built_once_per_size():
    cached_full_attention_rpb_index.cache_clear()
    attn = FullAttention(16, 2, rpb_size=(4, 4), num_global=1).eval()
    x = torch.randn(1, 1 + 5 * 6, 16)
    first, second = attn(x, (5, 6)), attn(x, (5, 6))
    assert torch.equal(first, second)
    info = cached_full_attention_rpb_index.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    assert torch.equal(cached_full_attention_rpb_index(5, 6, torch.device('cpu')), full_attention_rpb_index(5, 6))


def test_full_attention_of_another_size_trains_after_an_inference_mode_evaluation():
    """The index is cached at the first call, which may come from ``torch.inference_mode()``;
    autograd must still be able to save it when training follows."""
    cached_full_attention_rpb_index.cache_clear()
    attn = FullAttention(16, 2, rpb_size=(4, 4), num_global=1)
    x = torch.randn(1, 1 + 5 * 6, 16)
    with torch.inference_mode():
        attn(x, (5, 6))
    attn(x, (5, 6)).sum().backward()
    assert attn.local_relative_position_bias_table.grad.abs().sum() > 0


@pytest.mark.parametrize('model_class', [ViL, ViLLS])
def test_every_gradient_has_its_parameters_strides(model_class):
    """DDP warned "Grad strides do not match bucket view strides": it compares all strides of a gradient
    with its parameter's, autograd only those of dimensions larger than 1. With one head and one global
    token the g2g bias is (1, 1, 1), and a batch of one makes the global tokens' gradient a slice too."""
    torch.manual_seed(0)
    model = model_class(arch=TINY_ARCH)
    sum(out.mean() for out in model(torch.randn(1, 3, 64, 64))).backward()
    strides = {name: (p.stride(), p.grad.stride()) for name, p in model.named_parameters()}
    assert {name: pair for name, pair in strides.items() if pair[0] != pair[1]} == {}
