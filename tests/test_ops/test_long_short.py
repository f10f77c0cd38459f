"""Transformer-LS long-short attention against dense references written from its definition."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from visattn_mm.models.vil_attention import LongShortAttention
from visattn_mm.ops.common import dense_attention
from visattn_mm.ops.indexing import segment_pad
from visattn_mm.ops.long_short import dynamic_projection, long_short_attention, window_key_mask
from visattn_mm.ops.long_short.reference import long_short_attention_dense
from visattn_mm.ops.rel_pos import long_short_rpb_index, long_short_rpb_table_size

HEADS, DIM, RANK = 2, 4, 3


def random_inputs(height, width, window, num_global, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    n = height * width
    q, k, v = (r(2, HEADS, n, DIM) for _ in range(3))
    k_bar, v_bar = r(2, HEADS, RANK, DIM), r(2, HEADS, RANK, DIM)
    gk, gv = r(2, HEADS, num_global, DIM), r(2, HEADS, num_global, DIM)
    table = r(long_short_rpb_table_size(window), HEADS)
    return q, k, v, k_bar, v_bar, gk, gv, table


def both(q, k, v, height, width, window, k_bar, v_bar, gk, gv, table, use_bar=True):
    """The fast op and the dense reference on the same inputs (no global part when G = 0)."""
    extra = dict(
        k_bar=k_bar if use_bar else None,
        v_bar=v_bar if use_bar else None,
        global_k=gk if gk.shape[2] else None,
        global_v=gv if gv.shape[2] else None,
    )
    local_bias = table[long_short_rpb_index(window)].permute(2, 0, 1)
    fast = long_short_attention(q, k, v, height, width, window, local_bias=local_bias, **extra)
    ref = long_short_attention_dense(q, k, v, height, width, window, table=table, **extra)
    return fast, ref


# Square maps whose side is a multiple of w: the only maps the official code handles.
@pytest.mark.parametrize('side,window', [(6, 3), (14, 7), (8, 4), (16, 8), (5, 1)])
@pytest.mark.parametrize('num_global', [0, 1, 2])
def test_matches_dense_reference_on_official_maps(side, window, num_global):
    inputs = random_inputs(side, side, window, num_global)
    fast, ref = both(*inputs[:3], side, side, window, *inputs[3:])
    assert fast.shape == ref.shape
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


# Not multiples of w, non-square, fewer than 2 segments, smaller than one segment.
ODD_SIZES = [(7, 10, 3), (5, 4, 4), (2, 3, 7), (1, 1, 7), (13, 9, 7), (9, 17, 8)]


@pytest.mark.parametrize('height,width,window', ODD_SIZES)
def test_padding_does_not_change_the_window_part(height, width, window):
    """Window branch alone: equals the reference on the exact H x W definition (no padding
    exists there), and differs from a reference that treats the padding as real pixels."""
    q, k, v, k_bar, v_bar, gk, gv, table = random_inputs(height, width, window, 0)
    fast, ref = both(q, k, v, height, width, window, k_bar, v_bar, gk, gv, table, use_bar=False)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)

    # Control: the padded map with its zero keys visible would give other outputs.
    rows, cols = -(-height // window) * window, -(-width // window) * window
    if (rows, cols) != (height, width):

        def pad(t):
            t = t.reshape(2, HEADS, height, width, DIM)
            return F.pad(t, (0, 0, 0, cols - width, 0, rows - height)).reshape(2, HEADS, -1, DIM)

        padded = long_short_attention_dense(pad(q), pad(k), pad(v), rows, cols, window, table=table)
        real = padded.reshape(2, HEADS, rows, cols, DIM)[:, :, :height, :width].reshape(fast.shape)
        assert not torch.allclose(fast, real, atol=1e-3)


@pytest.mark.parametrize('height,width,window', ODD_SIZES)
@pytest.mark.parametrize('num_global', [0, 2])
def test_full_op_matches_reference_on_any_map(height, width, window, num_global):
    inputs = random_inputs(height, width, window, num_global, seed=1)
    fast, ref = both(*inputs[:3], height, width, window, *inputs[3:])
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_gradients_match_reference():
    height, width, window = 8, 11, 3
    inputs = [t.requires_grad_() for t in random_inputs(height, width, window, 1, seed=3)]
    fast, ref = both(*inputs[:3], height, width, window, *inputs[3:])
    grads_fast = torch.autograd.grad(fast.pow(2).sum(), inputs)
    grads_ref = torch.autograd.grad(ref.pow(2).sum(), inputs)
    for a, b in zip(grads_fast, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def dense_layer_reference(attn, x, hw, dp_padding=0):
    """The whole layer, densely, as the official code computes it (docs/backbones.md#the-vil-ls-long-short-layer).

    ``dp_padding`` > 0 builds the WRONG variant whose dynamic projection also runs over that
    many zero (padding) tokens, as a control.
    """
    g, heads = attn.num_global, attn.num_heads
    rank = attn.to_dynamic_projection.out_features // heads
    b, n, c = x.shape
    d = c // heads
    q, k, v = attn.qkv(x).split(c, dim=-1)
    q = q * d**-0.5
    k, v = attn.dual_ln_full(k), attn.dual_ln_full(v)  # all tokens, all channels
    local_x, local_k, local_v = x[:, g:], k[:, g:], v[:, g:]
    if dp_padding:
        local_x, local_k, local_v = (F.pad(t, (0, 0, 0, dp_padding)) for t in (local_x, local_k, local_v))
    logits = attn.to_dynamic_projection(local_x)  # (B, N, heads * r)
    # P[h, j] = softmax over the tokens of channel h * r + j.
    proj = torch.stack(
        [torch.stack([logits[:, :, h * rank + j].softmax(-1) for j in range(rank)], 1) for h in range(heads)], 1
    )  # (B, heads, r, N)

    def project(t):  # (B, N, C) -> (B, heads, r, d)
        per_head = [proj[:, h] @ t[..., h * d : (h + 1) * d] for h in range(heads)]
        merged = attn.dual_ln_dp(torch.cat(per_head, dim=-1))  # (B, r, C)
        return merged.reshape(b, rank, heads, d).transpose(1, 2)

    split = lambda t: t.reshape(b, -1, heads, d).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    local = long_short_attention_dense(
        q[:, :, g:],
        k[:, :, g:],
        v[:, :, g:],
        *hw,
        attn.window,
        k_bar=project(local_k),
        v_bar=project(local_v),
        global_k=k[:, :, :g] if g else None,
        global_v=v[:, :, :g] if g else None,
        table=attn.local_relative_position_bias_table,
    )
    out = local
    if g:
        # Global queries: their own keys/values and the local OUTPUTS as keys and values.
        glob = dense_attention(q[:, :, :g], torch.cat([k[:, :, :g], local], 2), torch.cat([v[:, :, :g], local], 2))
        out = torch.cat([glob, local], 2)
    return attn.proj(out.transpose(1, 2).reshape(b, n, c))


def make_layer(num_global, window, seed=0):
    torch.manual_seed(seed)
    attn = LongShortAttention(8, HEADS, window=window, dp_rank=RANK, num_global=num_global).double().eval()
    with torch.no_grad():  # non-trivial norms and biases
        for p in attn.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return attn


@pytest.mark.parametrize('hw,window', [((6, 6), 3), ((14, 14), 7), ((7, 10), 3), ((3, 2), 7), ((1, 1), 7)])
@pytest.mark.parametrize('num_global', [0, 1, 2])
def test_layer_matches_dense_reference(hw, window, num_global):
    attn = make_layer(num_global, window)
    x = torch.randn(2, num_global + hw[0] * hw[1], 8, dtype=torch.float64)
    torch.testing.assert_close(attn(x, hw), dense_layer_reference(attn, x, hw), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('hw,window', [((7, 10), 3), ((5, 9), 7)])
def test_dynamic_projection_excludes_padding(hw, window):
    """On a map that needs padding, the layer equals the reference whose projection runs over the
    H*W real tokens, and not the one that lets the padding tokens into the projection's softmax."""
    attn = make_layer(1, window)
    x = torch.randn(2, 1 + hw[0] * hw[1], 8, dtype=torch.float64)
    out = attn(x, hw)
    torch.testing.assert_close(out, dense_layer_reference(attn, x, hw), rtol=1e-5, atol=1e-5)
    rows, cols = (-(-s // window) * window for s in hw)
    wrong = dense_layer_reference(attn, x, hw, dp_padding=rows * cols - hw[0] * hw[1])
    assert not torch.allclose(out, wrong, atol=1e-3)


def test_layer_gradients_reach_every_parameter():
    attn = make_layer(1, 3).train()
    x = torch.randn(2, 1 + 5 * 7, 8, dtype=torch.float64, requires_grad=True)
    attn(x, (5, 7)).pow(2).sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())
    assert torch.isfinite(x.grad).all()


def test_layer_under_bf16_autocast():
    attn = make_layer(1, 7).float()
    x = torch.randn(1, 1 + 9 * 11, 8)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        low = attn(x, (9, 11))
    torch.testing.assert_close(low.float(), attn(x, (9, 11)), rtol=0.1, atol=0.1)


def test_rpb_index_reproduces_the_official_aliasing():
    w, p = 7, 3
    index = long_short_rpb_index(w)
    assert long_short_rpb_table_size(w) == 253 and long_short_rpb_table_size(8) == 375
    assert long_short_rpb_table_size(1) == 9
    assert index.shape == (49, 169) and index.min() == 0 and index.max() == 252
    # The exact formula for every pair: query (qy, qx) in [0, 7)^2, key in [-3, 10)^2.
    offsets = set()
    for qi, (qy, qx) in enumerate(itertools.product(range(w), repeat=2)):
        for ki, (ky, kx) in enumerate(itertools.product(range(-p, w + p), repeat=2)):
            assert index[qi, ki] == (qy - ky + 9) * 13 + (qx - kx + 9)
            offsets.add((qy - ky, qx - kx))
    assert len(offsets) == 361 and index.unique().numel() == 253
    # Hand-computed entries (columns: key row-major from (-3, -3), 13 per row).
    assert index[0, 0] == 168  # q (0, 0), k (-3, -3): rel (12, 12)
    assert index[0, 3 * 13 + 3] == 126  # q == k: rel (9, 9), the centre
    assert index[48, 168] == 84  # q (6, 6), k (9, 9): rel (6, 6)
    # Aliasing: offsets (0, +9) and (1, -4) share row 135.
    assert index[6, 3 * 13 + 0] == 135  # q (0, 6), k (0, -3)
    assert index[7, 3 * 13 + 7] == 135  # q (1, 0), k (0, 4)


def test_segment_pad_and_errors():
    assert [segment_pad(w) for w in (1, 2, 3, 7, 8)] == [1, 1, 1, 3, 4]
    assert all(segment_pad(w) == int(0.5 * w) for w in range(2, 20))  # the official RPB's p
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match='window'):
            segment_pad(bad)
    with pytest.raises(ValueError, match='num_heads'):
        dynamic_projection(torch.randn(1, 5, 7), 2)


def test_window_mask_hides_exactly_the_outside():
    # 5x4 map, w=3, p=1: 2x2 segments, 5x5 patches.
    hidden = window_key_mask(5, 4, 3, torch.device('cpu')).reshape(2, 2, 5, 5)
    first = torch.zeros(5, 5, dtype=torch.bool)
    first[0], first[:, 0] = True, True  # row -1 and column -1
    assert torch.equal(hidden[0, 0], first)
    last = torch.zeros(5, 5, dtype=torch.bool)
    last[3:], last[:, 2:] = True, True  # rows 5, 6 and columns 4, 5, 6
    assert torch.equal(hidden[1, 1], last)


def test_dynamic_projection_layout_and_precision():
    logits = torch.randn(2, 10, HEADS * RANK)
    proj = dynamic_projection(logits, HEADS)
    assert proj.shape == (2, HEADS, RANK, 10)
    torch.testing.assert_close(proj[:, 1, 2], logits[:, :, 1 * RANK + 2].softmax(-1))
    half = dynamic_projection(logits.bfloat16(), HEADS)
    assert half.dtype == torch.bfloat16
    assert torch.equal(
        half, logits.bfloat16().float().transpose(1, 2).reshape(2, HEADS, RANK, 10).softmax(-1).bfloat16()
    )


@pytest.mark.parametrize('impl', ['fast', 'math'])
@pytest.mark.parametrize('num_global', [0, 2])
def test_layer_gradients_match_dense_reference_on_each_path(impl, num_global):
    """Training, float64: the layer's output and the gradients of its input and of every parameter
    equal the dense reference's, on the fused path (row gathers from the whole q/k/v, keys and
    values regathered in backward) and on the explicit one."""
    from visattn_mm.ops.impl import attention_impl

    attn = make_layer(num_global, 3).train()
    x = torch.randn(2, num_global + 7 * 10, 8, dtype=torch.float64, requires_grad=True)
    with attention_impl(impl):
        out = attn(x, (7, 10))
    ref = dense_layer_reference(attn, x, (7, 10))
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    weight = torch.randn_like(out)
    params = [x, *attn.parameters()]
    grads = torch.autograd.grad((out * weight).sum(), params)
    for a, b in zip(grads, torch.autograd.grad((ref * weight).sum(), params)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('use_bias', [True, False])
def test_leading_global_fused_path_gradcheck(use_bias):
    """The fused path with the global tokens leading q/k/v (one gather per tensor) passes gradcheck
    in float64, the window bias included, and equals the reference on the sliced inputs."""
    height, width, window, g = 4, 5, 3, 1
    q, k, v, k_bar, v_bar, gk, gv, table = random_inputs(height, width, window, g, seed=5)
    q, k, v = (torch.cat([t_g, t], dim=2) for t_g, t in ((torch.randn_like(gk), q), (gk, k), (gv, v)))
    bias = table[long_short_rpb_index(window)].permute(2, 0, 1).contiguous() if use_bias else None
    inputs = [t.requires_grad_() for t in (q, k, v, k_bar, v_bar) + ((bias,) if use_bias else ())]

    def fused(q, k, v, k_bar, v_bar, bias=None):
        return long_short_attention(
            q, k, v, height, width, window, k_bar=k_bar, v_bar=v_bar, local_bias=bias, impl='fast', leading_global=g
        )

    assert torch.autograd.gradcheck(fused, inputs)
    ref = long_short_attention_dense(
        q[:, :, g:],
        k[:, :, g:],
        v[:, :, g:],
        height,
        width,
        window,
        k_bar=k_bar,
        v_bar=v_bar,
        global_k=k[:, :, :g],
        global_v=v[:, :, :g],
        table=table if use_bias else None,
    )
    torch.testing.assert_close(fused(*inputs), ref, rtol=1e-6, atol=1e-6)
