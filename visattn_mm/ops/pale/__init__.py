"""Pale-shaped self-attention (PS-Attention, parallel form) of the Pale Transformer.

Paper: "Pale Transformer: A General Vision Transformer Backbone with Pale-Shaped
Attention" (Wu et al., AAAI 2022); no official code was released. A pale of an
``H x W`` map is ``s_r`` interlaced rows plus ``s_c`` interlaced columns; the
parallel implementation splits the heads in two halves:

  * row half: the rows are cut into ``stride_r = H / s_r`` groups of ``s_r``
    interlaced rows -- group ``g`` holds rows ``g, g + stride_r, g + 2 stride_r, ...``
    -- and every query attends to the ``s_r * W`` tokens of its row group;
  * column half: likewise with ``s_c`` interlaced columns (stride ``W / s_c``) over
    the full height, ``s_c * H`` keys per query.

Any map size: the grouping axis is zero-padded at the end to ``stride * s`` with
``stride = ceil(side / s)``, padded keys are masked and padded queries cropped.
Equivalently, rows ``i`` and ``j`` share a row group iff ``i = j (mod ceil(H / s_r))``
(:func:`visattn_mm.ops.pale.reference.pale_attention_dense` is written from that rule).
Maps smaller than the pale size (``side < s``) use the effective pale size
``min(s, side)``: stride 1, one group holding the whole axis -- exactly what padding
to ``s`` with masked keys would compute, without the padded work. Every group holds
its row ``g < stride <= side``, so no query ever has all its keys masked.

Keys are gathered group-wise. The explicit ('math') path builds score tensors of
``(H / s_r) x (s_r W)^2`` and ``(W / s_c) x (s_c H)^2`` per head -- never ``(HW)^2``,
but growing like ``N^1.5``. The fused ('fast', default on CPU and CUDA) path runs
the groups through ``scaled_dot_product_attention`` and stores no scores, so its
memory is linear in N (see :mod:`visattn_mm.ops.impl`). Only the grouping axis is
padded; the other axis is used at its full size.

:func:`pale_attention`'s fused path (sizes known, i.e. not under torch.export with
dynamic shapes) pads nothing: one ``index_select`` per tensor gathers the tokens of
both halves at once, group by group, and one more scatters the outputs back. An axis
whose groups differ in size (``side`` not a multiple of the stride) holds its longer
groups first and those one line shorter after them; each kind is
one attention call without a key mask. From the projections' channels-last output
(what :class:`~visattn_mm.models.pale.PaleAttention` passes) that is three gathers, at
most four attention calls, a concatenation and a scatter per layer, where padding,
regrouping and transposing took about 30 copies and a boolean mask.
"""

import torch
import torch.nn.functional as F

from ..common import builds_for_every_size, dense_attention, device_cache, fused_attention
from ..impl import attention_path
from ..indexing import half_heads, interlace_stride, pale_size_pair


@device_cache
def padded_key_mask(side, length, pale_size, device):
    """Which gathered keys of each interlaced group are padding (True = hidden).

    Returns ``None`` when the axis needs no padding, else a BoolTensor
    ``(stride, 1, s_eff * length)``: key ``k * length + x`` of group ``g`` is line
    ``k * stride + g`` of the padded axis, hidden when that line is ``>= side``.
    A graph traced for every size (:func:`~visattn_mm.ops.common.builds_for_every_size`) always
    gets the mask, all False where nothing is padded, so that it serves padded and unpadded sizes.
    """
    size, stride, padded = interlace_stride(side, pale_size)
    if not builds_for_every_size(side) and padded == side:
        return None
    line = torch.arange(size)[None, :] * stride + torch.arange(stride)[:, None]  # (stride, s)
    hidden = (line >= side)[:, :, None].expand(stride, size, length)
    return hidden.reshape(stride, 1, size * length).to(device)


def interlaced_row_attention(q, k, v, height, width, pale_size, dropout_p=0.0, impl='auto'):
    """Self-attention within groups of ``s`` interlaced rows spanning the full width.

    Args:
        q (Tensor): ``(B, heads, H*W, d)`` queries, row-major, already scaled.
        k (Tensor): ``(B, heads, H*W, d)`` keys.
        v (Tensor): ``(B, heads, H*W, d_v)`` values.
        height (int): Map height ``H`` (the grouped axis).
        width (int): Map width ``W``.
        pale_size (int): Rows per group ``s`` (``min(s, H)`` is used).
        dropout_p (float): Dropout on the attention probabilities.
        impl (str): The path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.

    Returns:
        Tensor: ``(B, heads, H*W, d_v)``.
    """
    return _interlaced_rows(q, k, v, height, width, pale_size, dropout_p, _attend(attention_path(None, q, impl=impl)))


def _attend(path):
    """The softmax attention that ``path`` ('fast' or 'math') runs."""
    return fused_attention if path == 'fast' else dense_attention


def _interlaced_rows(q, k, v, height, width, pale_size, dropout_p, attend):
    """:func:`interlaced_row_attention` through ``attend`` (:func:`fused_attention` or :func:`dense_attention`)."""
    b, heads, n, _ = q.shape
    if n != height * width:
        raise ValueError(f'interlaced_row_attention: {n} tokens do not form a {height}x{width} map')
    size, stride, padded = interlace_stride(height, pale_size)

    def group(t):
        # Row k * stride + g of the padded map is line k of group g: (B, h, stride, s*W, d).
        d = t.shape[-1]
        t = F.pad(t.reshape(b, heads, height, width, d), (0, 0, 0, 0, 0, padded - height))
        t = t.reshape(b, heads, size, stride, width, d).transpose(2, 3)
        return t.reshape(b, heads, stride, size * width, d)

    # Groups as (B*h, stride, s*W, d): the (stride, 1, s*W) key mask broadcasts.
    out = attend(
        *(group(t).flatten(0, 1) for t in (q, k, v)),
        hidden=padded_key_mask(height, width, pale_size, q.device),
        dropout_p=dropout_p,
    )
    d = v.shape[-1]
    out = out.reshape(b, heads, stride, size, width, d).transpose(2, 3).reshape(b, heads, padded * width, d)
    if builds_for_every_size(n):
        # One graph serves padded and unpadded maps: a gathered crop is a new tensor either way,
        # where a slice's layout (and the graph's guards) would depend on it.
        return out.index_select(2, torch.arange(n, device=out.device))
    return out[:, :, :n]


def interlaced_column_attention(q, k, v, height, width, pale_size, dropout_p=0.0, impl='auto'):
    """Self-attention within groups of ``s`` interlaced columns spanning the full height.

    The row attention of the transposed map. Arguments and result as
    :func:`interlaced_row_attention`, with ``pale_size`` = columns per group.
    """
    return _interlaced_columns(
        q, k, v, height, width, pale_size, dropout_p, _attend(attention_path(None, q, impl=impl))
    )


def _interlaced_columns(q, k, v, height, width, pale_size, dropout_p, attend):
    """:func:`interlaced_column_attention` through ``attend``."""
    b, heads, n, _ = q.shape

    def transpose(t, h, w):
        return t.reshape(b, heads, h, w, -1).transpose(2, 3).reshape(b, heads, n, -1)

    out = _interlaced_rows(
        *(transpose(t, height, width) for t in (q, k, v)), width, height, pale_size, dropout_p, attend
    )
    return transpose(out, width, height)


def pale_attention(q, k, v, height, width, pale_size, dropout_p=0.0, impl='auto'):
    """Parallel PS-Attention: the first half of the heads attends within interlaced
    row groups, the second half within interlaced column groups.

    Args:
        q (Tensor): ``(B, heads, H*W, d)`` queries, row-major, already scaled;
            ``heads`` must be even.
        k (Tensor): ``(B, heads, H*W, d)`` keys.
        v (Tensor): ``(B, heads, H*W, d)`` values.
        height (int): Map height ``H``.
        width (int): Map width ``W``.
        pale_size (int | tuple[int, int]): ``s`` or ``(s_r, s_c)``.
        dropout_p (float): Dropout on the attention probabilities.
        impl (str): The path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.

    Returns:
        Tensor: ``(B, heads, H*W, d)``, row-branch heads first.
    """
    path = attention_path('pale', q, impl=impl, dropout_p=dropout_p)
    if path == 'triton':
        from .triton import triton_pale_attention

        return triton_pale_attention(q, k, v, height, width, pale_size, dropout_p=dropout_p)
    half = half_heads(q)
    s_r, s_c = pale_size_pair(pale_size)
    # The gathered path's token order depends on the sizes; the padded path's one graph serves every size.
    if path == 'fast' and not builds_for_every_size(*q.shape, height, width):
        return gathered_pale_attention(q, k, v, height, width, (s_r, s_c), dropout_p)
    attend = _attend(path)  # the path decided here is what the row and column parts run
    row = _interlaced_rows(q[:, :half], k[:, :half], v[:, :half], height, width, s_r, dropout_p, attend)
    col = _interlaced_columns(q[:, half:], k[:, half:], v[:, half:], height, width, s_c, dropout_p, attend)
    return torch.cat([row, col], dim=1)


@device_cache
def pale_gather_index(batch, height, width, pale_size, device):
    """Token order of :func:`gathered_pale_attention`: one gather serves both halves.

    The source is the ``(B * N * 2, heads / 2, d)`` view of token-major q, k or v:
    position ``(b * N + n) * 2 + half`` holds token ``n`` of image ``b`` for the row
    (``half = 0``) or the column half. The gathered order lists four blocks -- row
    groups holding ``m = ceil(side / stride)`` lines, row groups holding ``m - 1`` lines
    (the last ones when ``side`` is no multiple of the stride), then the same for the
    columns -- each
    ``(B, groups, lines, line length)``: group ``g`` holds lines ``g, g + stride, ...``
    ``< side``, a row line all ``W`` tokens of its row, a column line all ``H`` tokens of
    its column. Every token of each half appears exactly once, so no padding is gathered
    and none has to be masked.

    Args:
        batch (int): Images ``B``.
        height (int): Map height ``H``.
        width (int): Map width ``W``.
        pale_size (tuple[int, int]): ``(s_r, s_c)``.
        device (torch.device): Where the indices live.

    Returns:
        tuple: ``(index, inverse, blocks)``: LongTensors ``(B * N * 2,)`` with
        ``gathered = source[index]`` and ``source = gathered[inverse]``, and
        ``((groups, tokens per group), ...)`` of the non-empty blocks, in order.
    """
    n = height * width
    images = torch.arange(batch)[:, None] * (2 * n)
    pieces, blocks = [], []
    for half, (side, other, s, line_start, line_step) in enumerate(
        (
            (height, width, pale_size[0], lambda line: line * width, 1),
            (width, height, pale_size[1], lambda line: line, width),
        )
    ):
        _, stride, _ = interlace_stride(side, s)
        # Group g holds ceil((side - g) / stride) lines: ``size`` for the first ``full`` groups, one less
        # for the others (``size`` can be below s_eff, e.g. 5 lines per group for side 10, s 7, stride 2).
        size = -(-side // stride)
        full = side - (size - 1) * stride
        lines = torch.arange(size)[None, :] * stride + torch.arange(stride)[:, None]  # (stride, size)
        along = torch.arange(other) * line_step
        for groups, count in ((lines[:full], size), (lines[full:, : size - 1], size - 1)):
            if groups.numel() == 0:
                continue
            tokens = line_start(groups)[..., None] + along  # (groups, lines, other)
            pieces.append((images + 2 * tokens.reshape(1, -1) + half).reshape(-1))
            blocks.append((groups.shape[0], count * other))
    index = torch.cat(pieces)
    inverse = torch.empty_like(index)
    inverse[index] = torch.arange(index.numel())
    return index.to(device), inverse.to(device), tuple(blocks)


class RowPermutation(torch.autograd.Function):
    """``x.index_select(0, index)`` for a permutation ``index`` of ``x``'s rows.

    Its gradient is the gradient's rows gathered by the inverse permutation: one
    gather, where ``index_select``'s own backward zero-fills a buffer and scatters
    into it (``index_add``), two kernels that make no use of every row being hit
    exactly once.

    Args (of ``apply``):
        x (Tensor): ``(M, ...)``.
        index (LongTensor): ``(M,)``, a permutation of ``range(M)``.
        inverse (LongTensor): ``(M,)``, its inverse: ``index[inverse] == arange(M)``.

    Returns:
        Tensor: ``x[index]``.
    """

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(index, inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        index, inverse = ctx.saved_tensors
        # Through apply (not a bare index_select), so that a double backward is a gather too.
        return RowPermutation.apply(grad, inverse, index), None, None


def gathered_pale_attention(q, k, v, height, width, pale_size, dropout_p=0.0):
    """The fused path of :func:`pale_attention` for known sizes, as one gather per tensor.

    Arguments and result as :func:`pale_attention` (``pale_size`` a pair); the gathers
    read q, k and v in place when they are token-major (``(B, N, heads, d)`` memory,
    the projections' channels-last output), and the result is token-major, so that
    ``out.transpose(1, 2).reshape(B, N, C)`` is a view.
    """
    b, heads, n, _ = q.shape
    half = heads // 2
    index, inverse, blocks = pale_gather_index(b, height, width, pale_size, q.device)
    sizes = [b * groups * length for groups, length in blocks]

    def gather(t):
        if torch.compiler.is_exporting():
            # The traced projections are channels-last, their ONNX decomposition is not: one
            # layout keeps the reshape below a valid view (or a copy) in both graphs.
            t = t.contiguous()
        # Each block as (B * groups, heads / 2, tokens, d): a view of the gathered tensor.
        rows = RowPermutation.apply(t.transpose(1, 2).reshape(b * n * 2, half, t.shape[-1]), index, inverse)
        return [
            part.view(-1, length, half, t.shape[-1]).transpose(1, 2)
            for part, (_, length) in zip(rows.split(sizes), blocks)
        ]

    outs = [
        fused_attention(*group, dropout_p=dropout_p).transpose(1, 2).reshape(-1, half, v.shape[-1])
        for group in zip(gather(q), gather(k), gather(v))
    ]
    out = RowPermutation.apply(torch.cat(outs), inverse, index)
    return out.view(b, n, heads, v.shape[-1]).transpose(1, 2)
