"""Sliding-chunk attention against a dense reference with an explicit mask."""

import itertools

import pytest
import torch

from visattn_mm.ops.chunk_gather import ChunkGather
from visattn_mm.ops.impl import attention_impl
from visattn_mm.ops.rel_pos import full_attention_rpb_index, sliding_chunk_rpb_index
from visattn_mm.ops.sliding_chunk import key_mask, sliding_chunk_attention
from visattn_mm.ops.sliding_chunk.reference import sliding_chunk_attention_dense

HEADS, DIM = 2, 4


def random_inputs(height, width, window, num_global, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = height * width

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = (r(2, HEADS, n, DIM) for _ in range(3))
    gk, gv = r(2, HEADS, num_global, DIM), r(2, HEADS, num_global, DIM)
    table, l2g = r((4 * window - 1) ** 2, HEADS), r(HEADS, num_global)
    return q, k, v, gk, gv, table, l2g


def run_fast(q, k, v, height, width, window, gk, gv, table, l2g, masking_mode, shift_mode):
    w2 = window**2
    local_bias = table[sliding_chunk_rpb_index(window)].reshape(w2, 9 * w2, HEADS).permute(2, 0, 1)
    return sliding_chunk_attention(
        q,
        k,
        v,
        height,
        width,
        window,
        global_k=gk if gk.shape[2] else None,
        global_v=gv if gv.shape[2] else None,
        local_bias=local_bias,
        l2g_bias=l2g if gk.shape[2] else None,
        masking_mode=masking_mode,
        shift_mode=shift_mode,
    )


def run_reference(q, k, v, height, width, window, gk, gv, table, l2g, masking_mode, shift_mode):
    """The dense reference on the arguments of :func:`run_fast`: N x (G + N) logits, explicit bias and mask."""
    return sliding_chunk_attention_dense(
        q,
        k,
        v,
        height,
        width,
        window,
        global_k=gk,
        global_v=gv,
        table=table,
        l2g_bias=l2g,
        masking_mode=masking_mode,
        shift_mode=shift_mode,
    )


# (H, W, w): multiples of w and not, non-square, fewer than 3 chunks, smaller than a chunk.
SIZES = [(9, 9, 3), (10, 13, 3), (7, 8, 3), (2, 5, 3), (1, 1, 3), (15, 22, 7)]
CASES = [(mm, 0) for mm in (0, -1, 1)] + [(0, sm) for sm in (-1, *range(1, 9))] + [(-1, 3), (-1, -1)]


@pytest.mark.parametrize('height,width,window', SIZES)
@pytest.mark.parametrize('masking_mode,shift_mode', CASES)
@pytest.mark.parametrize('num_global', [0, 2])
def test_matches_dense_reference(height, width, window, masking_mode, shift_mode, num_global):
    rows, cols = -(-height // window), -(-width // window)
    if masking_mode == -1 and min(rows, cols) < 3:
        pytest.skip('cyclic wrap reaches one chunk through several offsets below 3 chunks per axis')
    inputs = random_inputs(height, width, window, num_global)
    q, k, v, gk, gv, table, l2g = inputs
    fast = run_fast(q, k, v, height, width, window, gk, gv, table, l2g, masking_mode, shift_mode)
    ref = run_reference(q, k, v, height, width, window, gk, gv, table, l2g, masking_mode, shift_mode)
    assert fast.shape == ref.shape == q.shape
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_gradients_match_reference():
    height, width, window = 8, 11, 3
    inputs = [t.requires_grad_() for t in random_inputs(height, width, window, 1, seed=3)]
    fast = run_fast(*inputs[:3], height, width, window, *inputs[3:], 0, 0)
    grads_fast = torch.autograd.grad(fast.pow(2).sum(), inputs)
    ref = run_reference(*inputs[:3], height, width, window, *inputs[3:], 0, 0)
    grads_ref = torch.autograd.grad(ref.pow(2).sum(), inputs)
    for a, b in zip(grads_fast, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('masking_mode,shift_mode,num_global', [(0, 0, 1), (-1, 0, 2), (1, 0, 0), (0, 5, 1)])
def test_fast_path_gradients_match_reference(masking_mode, shift_mode, num_global):
    """The fused path (gathers with their own backward) in float64: output and every gradient."""
    height, width, window = 10, 11, 3  # 4x4 chunks, the last row and column padded
    inputs = [t.requires_grad_() for t in random_inputs(height, width, window, num_global, seed=5)]
    with attention_impl('fast'):
        fast = run_fast(*inputs[:3], height, width, window, *inputs[3:], masking_mode, shift_mode)
    ref = run_reference(*inputs[:3], height, width, window, *inputs[3:], masking_mode, shift_mode)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-10)
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=ref.dtype)
    used = [t for t in inputs if t.numel()]
    grads_fast = torch.autograd.grad((fast * weights).sum(), used)
    grads_ref = torch.autograd.grad((ref * weights).sum(), used)
    for a, b in zip(grads_fast, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_chunk_gather_gradcheck():
    """Two outputs of two token tensors each, repeated rows and the extra row; float64 gradcheck."""
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randn(2, 3, n, 2, generator=g, dtype=torch.float64, requires_grad=True) for n in (1, 4) * 2]
    index = torch.tensor([5, 0, 1, 1, 4, 2, 5, 3, 1])
    features = torch.tensor([[1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    extra_row = torch.tensor([[0.0, 0.0, -7.0, 0.0], [0.0, 0.0, 0.0, 2.0]], dtype=torch.float64)
    keys, values = ChunkGather.apply(index, features, extra_row, *tokens)
    source = torch.cat(tokens[:2], dim=2).transpose(1, 2)
    expected = torch.cat([source, features[0].expand(2, 5, 3, 2)], dim=-1)
    expected = torch.cat([expected, extra_row[0].expand(2, 1, 3, 4)], dim=1)[:, index]
    assert torch.equal(keys, expected)
    assert torch.equal(values[:, 0], extra_row[1].expand(2, 3, 4))
    torch.autograd.gradcheck(lambda *t: ChunkGather.apply(index, features, extra_row, *t), tokens)


def test_hidden_keys_are_exactly_the_padding():
    height, width, window = 5, 4, 3
    for masking_mode in (0, -1):
        hidden = key_mask(height, width, window, masking_mode, 0, torch.device('cpu'))
        # Key chunk 0's own block for query chunk 0: rows 0-2, cols 0-2 all inside the image.
        own = hidden[0].reshape(9, 3, 3)[4]
        assert not own.any()
        # Chunk (1, 1) holds rows 3-5, cols 3-5: only (3, 3) and (4, 3) are inside a 5x4 image.
        last = hidden[3].reshape(9, 3, 3)[4]
        expected = torch.ones(3, 3, dtype=torch.bool)
        expected[0, 0] = expected[1, 0] = False
        assert torch.equal(last, expected)


def test_official_cyclic_mask_quirk_is_fixed():
    """The official cyclic mask forgets padded keys reached through the wrap; ours hides them."""
    height, width, window = 10, 9, 3  # 4 chunk rows, the last with 2 padded rows
    hidden = key_mask(height, width, window, -1, 0, torch.device('cpu'))
    # Query chunk (0, 0), neighbour (-1, 0) wraps to chunk row 3 (image rows 9-11): rows 10, 11 padded.
    block = hidden[0].reshape(9, 3, 3)[1]
    assert torch.equal(block.any(dim=1), torch.tensor([False, True, True]))


def test_rpb_index_formula():
    w = 7
    index = sliding_chunk_rpb_index(w)
    assert index.shape == (w * w, 9 * w * w)
    assert index.min() >= 0 and index.max() == (4 * w - 1) ** 2 - 1
    # Query (0, 0) vs key at (-w, -w) (first key of neighbour (-1, -1)): offset (w, w).
    assert index[0, 0] == (w + 2 * w - 1) * (4 * w - 1) + (w + 2 * w - 1)
    # Own chunk, query == key: offset (0, 0) -> the table centre.
    centre = (2 * w - 1) * (4 * w - 1) + (2 * w - 1)
    assert all(index[i, 4 * w * w + i] == centre for i in range(w * w))
    # A 14x14 full-attention table indexes offsets exactly like the w=7 chunk table.
    full = full_attention_rpb_index(14, 14)
    assert full.max() == 27 * 27 - 1
    for (qy, qx), (ky, kx) in itertools.product([(0, 0), (5, 13), (13, 2)], repeat=2):
        expected = (qy - ky + 13) * 27 + (qx - kx + 13)
        assert full[qy * 14 + qx, ky * 14 + kx] == expected


def test_masks_are_cached_per_shape():
    key_mask.cache_clear()
    key_mask(20, 30, 7, 0, 0, torch.device('cpu'))
    key_mask(20, 30, 7, 0, 0, torch.device('cpu'))
    info = key_mask.cache_info()
    assert info.hits == 1 and info.misses == 1


@pytest.mark.parametrize('impl', ['auto', 'fast', 'math'])
def test_invalid_modes_raise_clear_errors(impl):
    """The op checks its modes once, at its entry, whichever path would run."""
    q = torch.randn(1, 1, 64, 4)
    for modes, match in [((2, 0), 'masking_mode'), ((0, 9), 'shift_mode'), ((1, 4), 'exact')]:
        with pytest.raises(ValueError, match=match):
            sliding_chunk_attention(q, q, q, 8, 8, 3, masking_mode=modes[0], shift_mode=modes[1], impl=impl)


@pytest.mark.parametrize('impl', ['fast', 'math'])
def test_leading_global_tokens_equal_separate_ones(impl):
    """Global tokens at the front of q, k, v: the same output and gradients as passed apart (float64)."""
    height, width, window, num_global = 7, 8, 3, 2
    q, k, v, gk, gv, table, l2g = random_inputs(height, width, window, num_global, seed=7)
    q_all, k_all, v_all = (torch.cat([g, t], dim=2).requires_grad_() for g, t in ((gk, q), (gk, k), (gv, v)))
    local_bias = table[sliding_chunk_rpb_index(window)].reshape(9, 9 * 9, HEADS).permute(2, 0, 1)
    options = dict(local_bias=local_bias, l2g_bias=l2g, impl=impl)
    joint = sliding_chunk_attention(q_all, k_all, v_all, height, width, window, leading_global=num_global, **options)
    apart = sliding_chunk_attention(
        q_all[:, :, num_global:],
        k_all[:, :, num_global:],
        v_all[:, :, num_global:],
        height,
        width,
        window,
        global_k=k_all[:, :, :num_global],
        global_v=v_all[:, :, :num_global],
        **options,
    )
    torch.testing.assert_close(joint, apart, rtol=1e-12, atol=1e-12)
    weights = torch.randn(joint.shape, generator=torch.Generator().manual_seed(2), dtype=joint.dtype)
    for a, b in zip(
        torch.autograd.grad((joint * weights).sum(), (q_all, k_all, v_all)),
        torch.autograd.grad((apart * weights).sum(), (q_all, k_all, v_all)),
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match='leading_global'):
        sliding_chunk_attention(q_all, k_all, v_all, height, width, window, global_k=gk, leading_global=2)
