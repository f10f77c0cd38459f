"""PS-Attention (parallel pale-shaped attention): the gathered fast path against dense references."""

import pytest
import torch

from helpers import OpRecorder
from visattn_mm.ops.indexing import interlace_stride
from visattn_mm.ops.pale import RowPermutation, interlaced_column_attention, interlaced_row_attention, pale_attention
from visattn_mm.ops.pale.reference import pale_attention_dense


def qkv(height, width, heads=4, dim=3, batch=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, height * width, dim, generator=g, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize(
    'height,width,pale_size',
    [
        (14, 14, 7),  # divisible: stride 2 per axis
        (21, 7, 7),  # stride 3 rows, one column group
        (10, 23, 7),  # padded on both axes (10 -> 14, 23 -> 28)
        (37, 53, 7),  # odd sizes, padded
        (3, 5, 7),  # smaller than the pale size on both axes
        (2, 16, 7),  # smaller on one axis only
        (1, 1, 7),
        (1, 9, 7),
        (15, 8, (3, 5)),  # s_r != s_c
        (7, 9, 1),  # axial attention (one line per group)
    ],
)
def test_matches_dense_reference_in_float64(height, width, pale_size):
    q, k, v = qkv(height, width)
    out = pale_attention(q, k, v, height, width, pale_size)
    torch.testing.assert_close(out, pale_attention_dense(q, k, v, height, width, pale_size), rtol=1e-5, atol=1e-5)


def test_gradients_match_dense_reference():
    q, k, v = (t.requires_grad_() for t in qkv(10, 13, heads=2))
    grads = [
        torch.autograd.grad(f(q, k, v, 10, 13, 7).pow(2).sum(), (q, k, v))
        for f in (pale_attention, pale_attention_dense)
    ]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def visible_keys(attend, height, width, pale_size, query):
    """Keys a query reads, probed with zero queries (uniform weights) and one-hot values."""
    n = height * width
    q = torch.zeros(1, 1, n, 1, dtype=torch.float64)
    k = torch.randn(1, 1, n, 1, dtype=torch.float64)
    v = torch.eye(n, dtype=torch.float64)[None, None]
    weights = attend(q, k, v, height, width, pale_size)[0, 0, query[0] * width + query[1]]
    keys = {(int(i) // width, int(i) % width) for i in torch.nonzero(weights > 0)}
    torch.testing.assert_close(weights[weights > 0], torch.full((len(keys),), 1.0 / len(keys), dtype=torch.float64))
    return keys


@pytest.mark.parametrize(
    'height,rows',
    [
        (14, {1, 3, 5, 7, 9, 11, 13}),  # 7 interlaced rows, stride 14 / 7 = 2
        (21, {2, 5, 8, 11, 14, 17, 20}),  # stride 3
        (10, {1, 3, 5, 7, 9}),  # padded to 14 (stride 2): rows 11 and 13 are padding
        (4, {0, 1, 2, 3}),  # smaller than 7: the whole height
    ],
)
def test_row_groups_are_interlaced_rows_over_the_full_width(height, rows):
    """Written from the paper's definition (rows g, g + H/s_r, ...), not from the stride formula."""
    width = 5
    query = (max(rows), 2)
    assert visible_keys(interlaced_row_attention, height, width, 7, query) == {
        (r, x) for r in rows for x in range(width)
    }
    # The column branch of the transposed map is the same pattern.
    assert visible_keys(interlaced_column_attention, width, height, 7, query[::-1]) == {
        (x, r) for r in rows for x in range(width)
    }


def test_heads_split_between_row_and_column_halves():
    q, k, v = qkv(14, 21, heads=4)
    out = pale_attention(q, k, v, 14, 21, 7)
    torch.testing.assert_close(out[:, :2], interlaced_row_attention(q[:, :2], k[:, :2], v[:, :2], 14, 21, 7))
    torch.testing.assert_close(out[:, 2:], interlaced_column_attention(q[:, 2:], k[:, 2:], v[:, 2:], 14, 21, 7))
    with pytest.raises(ValueError, match='heads'):
        pale_attention(q[:, :3], k[:, :3], v[:, :3], 14, 21, 7)


def test_small_maps_use_the_effective_pale_size():
    """side < s: one group holding the whole axis, i.e. min(s, side) -- what padding to s would give."""
    assert interlace_stride(4, 7) == (4, 1, 4)
    assert interlace_stride(10, 7) == (7, 2, 14)
    assert interlace_stride(14, 7) == (7, 2, 14)
    q, k, v = qkv(4, 6)
    torch.testing.assert_close(pale_attention(q, k, v, 4, 6, 7), pale_attention(q, k, v, 4, 6, (4, 6)))
    with pytest.raises(ValueError, match='pale_size'):
        pale_attention(q, k, v, 4, 6, 0)


def test_no_quadratic_score_matrix():
    """56x56 map (stage 1 at 224): scores are (H/7) x (7W)^2 per head, far below (HW)^2."""
    q, k, v = (t.requires_grad_() for t in qkv(56, 56, heads=2, dim=4, batch=1, dtype=torch.float32))
    recorder = OpRecorder()
    with recorder:
        pale_attention(q, k, v, 56, 56, 7).sum().backward()
    n = 56 * 56
    assert recorder.max_numel <= 8 * (7 * 56) ** 2 < n**2 / 5, recorder.max_numel


@pytest.mark.parametrize('dtype', [torch.bfloat16, torch.float16])
def test_half_precision_softmax_is_finite(dtype):
    q, k, v = (t.to(dtype) * 20 for t in qkv(10, 12, dtype=torch.float32))
    out = pale_attention(q, k, v, 10, 12, 7)
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_row_permutation_gradients_in_float64():
    """RowPermutation's hand-written backward (a gather by the inverse) against autograd's numerics."""
    x = torch.randn(6, 2, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([3, 0, 5, 1, 4, 2])
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(6)
    torch.testing.assert_close(RowPermutation.apply(x, index, inverse), x[index])
    assert torch.autograd.gradcheck(lambda t: RowPermutation.apply(t, index, inverse), (x,))
    assert torch.autograd.gradgradcheck(lambda t: RowPermutation.apply(t, index, inverse), (x,))


@pytest.mark.parametrize(
    'height,width,pale_size',
    [
        (5, 4, (2, 3)),  # groups of 2 and 1 rows, of 2 and 1 columns: four attention calls
        (4, 6, 2),  # every group full
        (3, 2, 7),  # smaller than the pale size: one group per half
    ],
)
def test_gathered_path_gradcheck_in_float64(height, width, pale_size):
    q, k, v = (t.requires_grad_() for t in qkv(height, width, heads=2, dim=2, batch=2))
    assert torch.autograd.gradcheck(lambda *t: pale_attention(*t, height, width, pale_size, impl='fast'), (q, k, v))


def test_gathered_path_on_token_major_inputs_moves_no_padding():
    """What PaleAttention passes (channels-last projections): each of q, k, v is read in place by one
    gather, the output is one concatenation and one scatter, backward one concatenation and one gather
    per tensor; no pad, no mask, no other copy. Padded sizes (10 x 23) included; equal to the dense reference."""
    b, heads, height, width, d = 2, 4, 10, 23, 3
    n = height * width
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(b, n, heads, d, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_() for _ in range(3)
    )
    pale_attention(q, k, v, height, width, 7, impl='fast')  # builds the cached indices
    recorder = OpRecorder()
    with recorder:
        out = pale_attention(q, k, v, height, width, 7, impl='fast')
        out.backward(torch.ones_like(out))
    names = [name for name, _, _ in recorder.calls]
    assert names.count('index_select') == 4 + 4, names
    assert names.count('cat') == 1 + 3, names  # the attention outputs; backward: each tensor's blocks
    assert not {'constant_pad_nd', 'clone', 'masked_fill', 'index_add', 'copy_'} & set(names), names
    assert out.transpose(1, 2).is_contiguous()  # the model's (B, N, C) reshape is a view
    torch.testing.assert_close(out, pale_attention_dense(q, k, v, height, width, 7), rtol=1e-5, atol=1e-5)
