"""Any input size, the four padding cases of each padded attention, and padded batches.

Output sides. ViL / ViL-LS pad each stage's input at the bottom/right to a multiple of
the patch size ``p`` and apply a ``p x p`` stride-``p`` conv: ``ceil(H / p)``. VVT / Pale
use overlapping convs with kernel ``k``, stride ``s``, padding ``k // 2`` (7/4/3 and 3/2/1):
``floor((H + 2 (k // 2) - k) / s) + 1 = floor((H - 1) / s) + 1 = ceil(H / s)`` for
``k = 2s - 1``. Chained, output ``i`` is ``ceil(H / stride_i)`` for strides 4, 8, 16,
32 (``ceil(ceil(H / a) / b) = ceil(H / ab)``), down to a 1x1 input: no minimum size.

Padded batches. The data preprocessor pads each image at the bottom/right with zeros
(after normalisation) and the backbones get no mask of that padding, so the padded
pixels are real tokens for them. What stays exact is local: an attention output whose
visible keys are all valid is the same as for the unpadded image, because the chunk
(ViL) and segment (ViL-LS) grids are anchored at the top-left. The tests below check that
exactly at op level, and measure (and bound) how far the global parts move: ViL's global
tokens, ViL-LS's dynamic projection, VVT's vicinity attention (positions scaled by the
padded H, W; an SE gate over all tokens) and Pale, whose interlaced row/column groups have
stride ceil(H / s) of the padded size, so that no Pale output is exact in a padded batch.
"""

import pytest
import test_long_short as ls_tests
import test_sliding_chunk as sc_tests
import torch
import torch.nn.functional as F

from helpers import BACKBONES, PALE_TINY_ARCH, TINY_ARCHS, assert_dense_outputs, build_tiny
from visattn_mm.models import PaleTransformer, ViL
from visattn_mm.ops.indexing import segment_pad
from visattn_mm.ops.long_short import long_short_attention
from visattn_mm.ops.pale import pale_attention
from visattn_mm.ops.pale.reference import pale_attention_dense
from visattn_mm.ops.sliding_chunk import sliding_chunk_attention
from visattn_mm.ops.sliding_chunk.reference import sliding_chunk_visibility

# Odd, prime, non-square, smaller than a chunk / pale / stride, not divisible by 32.
SIZES = [(1, 1), (3, 2), (5, 7), (13, 31), (33, 65), (17, 6)]


@pytest.fixture(scope='module', params=BACKBONES, ids=lambda cls: cls.__name__)
def tiny_model(request):
    torch.manual_seed(0)
    return build_tiny(request.param).eval()


def patch_embed_convs(model):
    """The four patch-embedding convs and whether the stage pads its input to the stride first."""
    return [(stage.patch_embed.proj, isinstance(model, ViL)) for stage in model.stages]


def conv_output_side(side, conv, pads_to_stride, axis):
    """The side a conv produces, from its own kernel/stride/padding (``pads_to_stride``: ViL's pre-pad)."""
    k, s, p = conv.kernel_size[axis], conv.stride[axis], conv.padding[axis]
    if pads_to_stride:
        side += -side % s
    return (side + 2 * p - k) // s + 1


@pytest.mark.parametrize('size', SIZES)
def test_output_sides_follow_the_conv_chain_and_equal_ceil(tiny_model, size):
    with torch.no_grad():
        outs = tiny_model(torch.randn(1, 3, *size))
    sides = list(size)
    for out, (conv, pads) in zip(outs, patch_embed_convs(tiny_model)):
        sides = [conv_output_side(sides[a], conv, pads, a) for a in range(2)]
        assert tuple(out.shape[-2:]) == tuple(sides)
    assert_dense_outputs(outs, 1, size, TINY_ARCHS[type(tiny_model)]['embed_dims'])


# ---- The four padding cases (Twins' bug: a mask built for one side applied to the other) ----
# Amounts differ per axis so a swapped mask shows. Covered elsewhere already (not repeated):
# sliding chunk "neither" and "both" (test_sliding_chunk.SIZES), long-short "bottom" and "both"
# (test_long_short.ODD_SIZES), pale "neither", "right" and "both" (test_pale_attention).


@pytest.mark.parametrize('height,width', [(9, 10), (10, 9)], ids=['right_only', 'bottom_only'])
@pytest.mark.parametrize('masking_mode', [0, -1, 1])
@pytest.mark.parametrize('num_global', [0, 2])
def test_sliding_chunk_one_sided_padding(height, width, masking_mode, num_global):
    q, k, v, gk, gv, table, l2g = sc_tests.random_inputs(height, width, 3, num_global)
    fast = sc_tests.run_fast(q, k, v, height, width, 3, gk, gv, table, l2g, masking_mode, 0)
    ref = sc_tests.run_reference(q, k, v, height, width, 3, gk, gv, table, l2g, masking_mode, 0)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('height,width', [(6, 7), (6, 9)], ids=['right_only', 'neither'])
@pytest.mark.parametrize('num_global', [0, 2])
def test_long_short_right_only_and_unpadded_non_square(height, width, num_global):
    inputs = ls_tests.random_inputs(height, width, 3, num_global)
    fast, ref = ls_tests.both(*inputs[:3], height, width, 3, *inputs[3:])
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('height,width,pale_size', [(10, 21, 7), (11, 9, (3, 3))], ids=['bottom_7', 'bottom_3'])
def test_pale_bottom_only_padding(height, width, pale_size):
    q, k, v = (
        torch.randn(2, 4, height * width, 3, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        for i in range(3)
    )
    torch.testing.assert_close(
        pale_attention(q, k, v, height, width, pale_size),
        pale_attention_dense(q, k, v, height, width, pale_size),
        rtol=1e-10,
        atol=1e-10,
    )


# ---- Padded batches ----


def pad_tokens(t, height, width, pad_h, pad_w, value=0.0):
    """(B, heads, H*W, d) tokens of an H x W map -> the map padded at the bottom/right."""
    b, heads, _, d = t.shape
    grid = t.reshape(b, heads, height, width, d)
    return F.pad(grid, (0, 0, 0, pad_w, 0, pad_h), value=value).reshape(b, heads, -1, d)


def valid_part(t, height, width, padded_w):
    """The H x W top-left part of tokens of a map ``padded_w`` wide, flattened."""
    b, heads, _, d = t.shape
    return t.reshape(b, heads, -1, padded_w, d)[:, :, :height, :width].reshape(b, heads, -1, d)


PAD_CASES = [(0, 0), (0, 5), (4, 0), (4, 5)]
PAD_IDS = ['neither', 'right', 'bottom', 'both']


@pytest.mark.parametrize('pad_h,pad_w', PAD_CASES, ids=PAD_IDS)
def test_sliding_chunk_padded_batch_is_exact_where_no_padding_is_visible(pad_h, pad_w):
    """Mode 0, no global tokens: queries that see no padded key get bit-for-bit the same result;
    the ones that see padding (the preprocessor's zeros are real tokens to the model) change."""
    height, width, window = 10, 11, 3
    q, k, v = (
        torch.randn(1, 2, height * width, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        for i in range(3)
    )
    ph, pw = height + pad_h, width + pad_w
    alone = sliding_chunk_attention(q, k, v, height, width, window)
    padded = sliding_chunk_attention(*(pad_tokens(t, height, width, pad_h, pad_w) for t in (q, k, v)), ph, pw, window)
    clean = clean_sliding_chunk_queries(height, width, pad_h, pad_w, window)
    got = valid_part(padded, height, width, pw)
    torch.testing.assert_close(got[:, :, clean], alone[:, :, clean], rtol=0, atol=1e-12)
    if pad_h or pad_w:
        assert 0 < clean.sum() < clean.numel()
        assert (got[:, :, ~clean] - alone[:, :, ~clean]).abs().amax() > 1e-3


@pytest.mark.parametrize('pad_h,pad_w', PAD_CASES, ids=PAD_IDS)
def test_long_short_window_branch_padded_batch_is_exact_away_from_padding(pad_h, pad_w):
    """Window branch alone: a query of segment (sy, sx) sees rows [w sy - p, w sy + w + p);
    those whose window stays inside the image are unchanged by a padded batch."""
    height, width, window = 13, 14, 3
    q, k, v = (
        torch.randn(1, 2, height * width, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        for i in range(3)
    )
    alone = long_short_attention(q, k, v, height, width, window)
    padded = long_short_attention(
        *(pad_tokens(t, height, width, pad_h, pad_w) for t in (q, k, v)), height + pad_h, width + pad_w, window
    )
    got = valid_part(padded, height, width, width + pad_w)
    clean = clean_long_short_queries(height, width, pad_h, pad_w, window)
    torch.testing.assert_close(got[:, :, clean], alone[:, :, clean], rtol=0, atol=1e-12)
    if pad_h or pad_w:
        assert 0 < clean.sum() < clean.numel()
        assert (got[:, :, ~clean] - alone[:, :, ~clean]).abs().amax() > 1e-3


def clean_sliding_chunk_queries(height, width, pad_h, pad_w, window):
    """Valid queries (row-major over H x W) that see no padded key in mode 0."""
    ph, pw = height + pad_h, width + pad_w
    visible, _ = sliding_chunk_visibility(ph, pw, window)
    ys, xs = torch.arange(ph).repeat_interleave(pw), torch.arange(pw).repeat(ph)
    sees_padding = (visible & ((ys >= height) | (xs >= width))[None]).any(1)
    return ~sees_padding.reshape(ph, pw)[:height, :width].reshape(-1)


def clean_long_short_queries(height, width, pad_h, pad_w, window):
    """Valid queries whose segment window (``p`` beyond the segment) stays inside the image."""

    def inside(side):  # the last row/column each query's window reaches stays inside the image
        return (torch.arange(side) // window) * window + window + segment_pad(window) <= side

    rows = inside(height) | (pad_h == 0)
    cols = inside(width) | (pad_w == 0)
    return (rows[:, None] & cols[None]).reshape(-1)


def layer_change(layer, height, width, pad_h, pad_w, num_global=0, dim=8):
    """A layer on an H x W map and on the map zero-padded at the bottom/right.

    Returns the valid local outputs of both runs (row-major over H x W) and the largest
    change of the global-token outputs (0 without global tokens).
    """
    torch.manual_seed(0)
    x = torch.randn(1, num_global + height * width, dim, dtype=torch.float64)
    grid = x[:, num_global:].reshape(1, height, width, dim)
    padded = torch.cat([x[:, :num_global], F.pad(grid, (0, 0, 0, pad_w, 0, pad_h)).flatten(1, 2)], 1)
    with torch.no_grad():
        alone = layer(x, (height, width))
        out = layer(padded, (height + pad_h, width + pad_w))
    valid = out[:, num_global:].reshape(1, height + pad_h, width + pad_w, dim)[:, :height, :width].flatten(1, 2)
    global_change = (out[:, :num_global] - alone[:, :num_global]).abs().amax() if num_global else 0.0
    return alone[:, num_global:], valid, float(global_change)


def relative(a, b):
    return float((a - b).abs().amax() / b.abs().amax())


# Upper bounds of the relative change max|padded - alone| / max|alone| (seed 0; layers in float64,
# models in float32), each about 1.5x the value measured by the test it bounds (printed with -s).
LAYER_BOUNDS = {'vil_global_tokens': 0.15, 'long_short_clean_queries': 0.10, 'vicinity_all': 0.21, 'pale_all': 0.27}
MODEL_BOUNDS = {
    'ViL': (0.0015, 0.003, 0.005, 1.25),
    'ViLLS': (0.03, 0.045, 0.06, 1.3),
    'VVT': (0.0002, 0.005, 0.01, 0.85),
    'PaleTransformer': (0.6, 0.8, 0.4, 0.85),
}


@pytest.mark.parametrize('pad_h,pad_w', PAD_CASES[1:], ids=PAD_IDS[1:])
def test_global_parts_move_by_a_bounded_amount_in_a_padded_batch(pad_h, pad_w):
    """Layer level, 10x11 map padded by 4/5 zero tokens. ViL: local queries that see no padding
    are exact (their global keys come from the unchanged global token inputs); only the global
    tokens' own outputs move. ViL-LS: the dynamic projection (a softmax over all tokens,
    padding included) moves even the queries whose window is clean. VVT: positions are scaled
    by the padded H, W and the SE gate averages all tokens, so every output moves. Pale: the
    interlaced groups have stride ceil(H / s) of the padded H, so every output moves."""
    from visattn_mm.models.pale import PaleAttention
    from visattn_mm.models.vil_attention import LongShortAttention, SlidingChunkAttention
    from visattn_mm.models.vvt import VicinityAttention

    height, width, window = 10, 11, 3
    torch.manual_seed(0)
    layers = dict(
        vil=SlidingChunkAttention(8, 2, window=window, num_global=1),
        long_short=LongShortAttention(8, 2, window=window, dp_rank=2, num_global=1),
        vicinity=VicinityAttention(8, 2),
        pale=PaleAttention(8, 2, pale_size=3),
    )
    layers = {k: m.double().eval() for k, m in layers.items()}

    alone, valid, global_change = layer_change(layers['vil'], height, width, pad_h, pad_w, num_global=1)
    clean = clean_sliding_chunk_queries(height, width, pad_h, pad_w, window)
    torch.testing.assert_close(valid[:, clean], alone[:, clean], rtol=0, atol=1e-12)
    changes = {'vil_global_tokens': global_change / float(alone.abs().amax())}

    alone, valid, _ = layer_change(layers['long_short'], height, width, pad_h, pad_w, num_global=1)
    clean = clean_long_short_queries(height, width, pad_h, pad_w, window)
    changes['long_short_clean_queries'] = relative(valid[:, clean], alone[:, clean])
    changes['vicinity_all'] = relative(*layer_change(layers['vicinity'], height, width, pad_h, pad_w)[1::-1])
    changes['pale_all'] = relative(*layer_change(layers['pale'], height, width, pad_h, pad_w)[1::-1])
    print(pad_h, pad_w, {k: round(v, 4) for k, v in changes.items()})
    for key, change in changes.items():
        assert 0 < change <= LAYER_BOUNDS[key], (key, change)


def padded_batch_relative_change(model, size=(45, 61), padded=(64, 64)):
    """max |out(padded) - out(alone)| / max |out(alone)| over each output's valid region."""
    torch.manual_seed(0)
    x = torch.randn(1, 3, *size)
    xp = F.pad(x, (0, padded[1] - size[1], 0, padded[0] - size[0]))
    with torch.no_grad():
        alone, pad = model(x), model(xp)
    return [relative(b[..., : a.shape[-2], : a.shape[-1]], a) for a, b in zip(alone, pad)]


def test_whole_backbone_change_in_a_padded_batch_is_bounded(tiny_model):
    """Model level (tiny archs, a 45x61 image zero-padded to 64x64, over the whole valid region,
    border included, where the convs also see the padding)."""
    name = type(tiny_model).__name__
    changes = padded_batch_relative_change(tiny_model)
    print(name, [round(c, 4) for c in changes])
    assert all(0 < c <= bound for c, bound in zip(changes, MODEL_BOUNDS[name])), (name, changes)


def test_pale_training_needs_two_values_per_channel_and_says_so():
    """Pale's q/k/v BatchNorms in training: the one size limit, named with the way out."""
    model = build_tiny(PaleTransformer).train()
    with pytest.raises(ValueError, match=r'more than 1 value per channel at stride 32.*\(32, 17\) gives 1'):
        model(torch.randn(1, 3, 32, 17))
    for x in (torch.randn(1, 3, 33, 17), torch.randn(2, 3, 1, 1)):  # 2 values at stride 32
        assert_dense_outputs(model(x), x.shape[0], x.shape[2:], PALE_TINY_ARCH['embed_dims'])
    model.eval()
    assert_dense_outputs(model(torch.randn(1, 3, 1, 1)), 1, (1, 1), PALE_TINY_ARCH['embed_dims'])
