"""Naive dense attention: the reference every fast path is tested against.

These build the full ``N x N`` logit matrix with an explicit bias and mask.
They are exact and simple, and quadratic in memory: use them for tests and for
small maps only.
"""

import torch
import torch.nn.functional as F

from .common import chunk_grid, dense_attention
from .indexing import EPS, NEIGHBOUR_OFFSETS, check_modes, neighbour_blocks, pale_size_pair, segment_pad
from .rel_pos import long_short_rpb_row, sliding_chunk_rpb_row
from .vicinity import signed_clamp

__all__ = [
    'sliding_chunk_visibility',
    'sliding_chunk_attention_dense',
    'vicinity_attention_dense',
    'long_short_attention_dense',
    'pale_attention_dense',
]


def _pixel_coordinates(height, width):
    """Row and column ``(ys, xs)`` of the ``H*W`` pixels of a map, row-major, each of shape ``(N,)``."""
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing='ij')
    return ys.reshape(-1), xs.reshape(-1)


def sliding_chunk_visibility(height, width, window, masking_mode=0, shift_mode=0):
    """Explicit ``(N, N)`` visibility and chunk offsets of ViL local attention.

    Written from the definition, pixel pair by pixel pair, without chunk tensors:
    key ``j`` is visible to query ``i`` when the chunk offset between them is one of
    the shift mode's neighbour offsets (taken modulo the chunk grid in cyclic mode,
    which therefore needs at least 3 chunks per axis here), the key is inside the
    image, and -- for the exact mode -- within ``+-w`` rows and columns.

    Returns:
        tuple: ``visible`` (BoolTensor ``(N, N)``) and ``rel`` (LongTensor
        ``(N, N, 2)``), the query-minus-key offset in unwrapped coordinates (the
        offset the RPB table is indexed with).
    """
    check_modes(masking_mode, shift_mode)
    w = window
    rows, cols = chunk_grid(height, width, w)
    if masking_mode == -1 and (rows < 3 or cols < 3):
        raise ValueError('the dense reference of cyclic mode needs at least 3 chunks per axis')
    ys, xs = _pixel_coordinates(height, width)
    chunk_dy = ys[None] // w - ys[:, None] // w  # key chunk - query chunk
    chunk_dx = xs[None] // w - xs[:, None] // w
    allowed = [NEIGHBOUR_OFFSETS[b] for b in neighbour_blocks(shift_mode)]
    visible = torch.zeros(len(ys), len(ys), dtype=torch.bool)
    rel_y = ys[:, None] - ys[None]
    rel_x = xs[:, None] - xs[None]
    for oy, ox in allowed:
        if masking_mode == -1:
            hit = ((chunk_dy - oy) % rows == 0) & ((chunk_dx - ox) % cols == 0)
            # Unwrapped key position = query chunk + offset, same place inside the chunk.
            rel_y = torch.where(hit, (ys % w)[:, None] - (ys % w)[None] - oy * w, rel_y)
            rel_x = torch.where(hit, (xs % w)[:, None] - (xs % w)[None] - ox * w, rel_x)
        else:
            hit = (chunk_dy == oy) & (chunk_dx == ox)
        visible |= hit
    if masking_mode == 1:
        visible &= (rel_y.abs() <= w) & (rel_x.abs() <= w)
    return visible, torch.stack([rel_y, rel_x], dim=-1)


def sliding_chunk_attention_dense(
    q,
    k,
    v,
    height,
    width,
    window,
    *,
    global_k=None,
    global_v=None,
    table=None,
    l2g_bias=None,
    masking_mode=0,
    shift_mode=0,
):
    """ViL sliding-chunk attention of the local queries, written densely from its definition.

    One softmax per query over ``[the G global keys | the H*W pixels]``, the pixels
    that :func:`sliding_chunk_visibility` does not mark visible hidden. A visible
    pixel pair gets the bias ``table[(ry + 2w - 1) * (4w - 1) + rx + 2w - 1]`` for
    its query-minus-key offset ``(ry, rx)`` (unwrapped in cyclic mode; within
    ``+-(2w - 1)`` per axis; :func:`~visattn_mm.ops.rel_pos.sliding_chunk_rpb_row`); a
    global key gets its ``l2g_bias``. No chunks, no padding: the map is exactly ``H x W``.

    Args:
        q, k, v (Tensor): ``(B, heads, H*W, d)`` local queries (already scaled), keys and values.
        height, width (int): Map size ``H x W``.
        window (int): Chunk size ``w``.
        global_k, global_v (Tensor, optional): ``(B, heads, G, d)`` global keys and values.
        table (Tensor, optional): ``((4w - 1)**2, heads)`` RPB table.
        l2g_bias (Tensor, optional): ``(heads, G)`` bias of the local->global logits.
        masking_mode (int): 0, -1 or 1 (cyclic mode needs 3 chunks per axis here).
        shift_mode (int): 0, -1 or 1..8.

    Returns:
        Tensor: ``(B, heads, H*W, d)``.
    """
    visible, rel = (t.to(q.device) for t in sliding_chunk_visibility(height, width, window, masking_mode, shift_mode))
    heads, n = q.shape[1], height * width
    num_global = 0 if global_k is None else global_k.shape[2]
    bias = q.new_zeros(heads, n, n)
    if table is not None:
        index = sliding_chunk_rpb_row(rel[..., 0], rel[..., 1], window)
        # Hidden pairs may lie farther apart than any table row; their bias is never used.
        index = torch.where(visible, index, torch.zeros_like(index))
        bias = table[index].permute(2, 0, 1).to(q.dtype)
    to_global = q.new_zeros(heads, num_global) if l2g_bias is None else l2g_bias.to(q.dtype)
    bias = torch.cat([to_global[:, None, :].expand(heads, n, num_global), bias], dim=-1)
    hidden = torch.cat([visible.new_zeros(n, num_global), ~visible], dim=-1)
    keys = k if global_k is None else torch.cat([global_k, k], dim=2)
    values = v if global_v is None else torch.cat([global_v, v], dim=2)
    return dense_attention(q, keys, values, bias, hidden)


def vicinity_attention_dense(q, k, v, height, width, eps=EPS, clamp=True):
    """Vicinity attention in its quadratic form: explicit ``(N, N)`` weights.

    ``w_ij = (relu(q_i) . relu(k_j)) (cos(a_i - a_j) + cos(b_i - b_j))`` with
    ``a = pi * row / (2H)`` and ``b = pi * col / (2W)`` (paper Eq. 9-10), rows
    normalised as ``out_i = (sum_j w_ij v_j) / (sum_j w_ij + eps)``. With
    ``clamp``, the signed clamp of the linear form is applied where it has a
    counterpart here: to ``1 / (sum_j w_ij + eps)``, to ``sum_j w_ij v_j`` and to
    their product. The linear form's clamp of ``KV = k'^T v`` has none, so the two
    agree wherever that clamp is inactive.

    Args: as :func:`visattn_mm.ops.vicinity.vicinity_attention`.
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(compute), k.to(compute), v.to(compute)
    rows = torch.arange(height).repeat_interleave(width).to(compute)
    cols = torch.arange(width).repeat(height).to(compute)
    a = torch.pi * rows / (2 * height)
    b = torch.pi * cols / (2 * width)
    locality = torch.cos(a[:, None] - a[None]) + torch.cos(b[:, None] - b[None])  # (N, N)
    weights = (q.relu() @ k.relu().transpose(-1, -2)) * locality  # (..., N, N)
    norm = 1.0 / (weights.sum(dim=-1, keepdim=True) + eps)
    numerator = weights @ v
    if clamp:
        norm, numerator = signed_clamp(norm), signed_clamp(numerator)
    out = numerator * norm
    return signed_clamp(out) if clamp else out


def long_short_attention_dense(
    q, k, v, height, width, window, *, k_bar=None, v_bar=None, global_k=None, global_v=None, table=None
):
    """Long-short attention of the local queries, written densely from its definition.

    Query ``(qy, qx)`` belongs to segment ``(qy // w, qx // w)`` and sees the image
    pixels ``(ky, kx)`` with ``w * (qy // w) - p <= ky < w * (qy // w) + w + p`` (and
    likewise for x), ``p = max(w // 2, 1)``, plus every projected key and every global
    key: one softmax over ``[K_bar | the H*W pixels, invisible ones hidden | global]``.
    The window bias of a visible pair is ``table[ry * (2p + w) + rx]`` with
    ``(ry, rx) = q - k + (p + w - 1)`` (the official aliasing formula,
    :func:`~visattn_mm.ops.rel_pos.long_short_rpb_row`). There is no
    padding here: the map is exactly ``H x W``.

    Args:
        q, k, v (Tensor): ``(B, heads, H*W, d)`` local queries (already scaled), keys and values.
        height, width (int): Map size ``H x W``.
        window (int): Segment size ``w``.
        k_bar, v_bar (Tensor, optional): ``(B, heads, r, d)`` projected keys and values.
        global_k, global_v (Tensor, optional): ``(B, heads, G, d)`` global keys and values.
        table (Tensor, optional): ``(rows, heads)`` window RPB table.

    Returns:
        Tensor: ``(B, heads, H*W, d)``.
    """
    w, p = window, segment_pad(window)
    heads, n = q.shape[1], height * width
    ys, xs = _pixel_coordinates(height, width)
    top, left = (ys // w * w)[:, None], (xs // w * w)[:, None]
    visible = (ys[None] >= top - p) & (ys[None] < top + w + p) & (xs[None] >= left - p) & (xs[None] < left + w + p)
    bias = torch.zeros(heads, n, n, dtype=q.dtype)
    if table is not None:
        index = long_short_rpb_row(ys[:, None] - ys[None], xs[:, None] - xs[None], w)
        index = torch.where(visible, index, torch.zeros_like(index))
        bias = table[index].permute(2, 0, 1).to(q.dtype)
    r = 0 if k_bar is None else k_bar.shape[2]
    g = 0 if global_k is None else global_k.shape[2]
    keys = torch.cat([t for t in (k_bar, k, global_k) if t is not None], dim=2)
    values = torch.cat([t for t in (v_bar, v, global_v) if t is not None], dim=2)
    no_mask = torch.zeros(n, r + g, dtype=torch.bool)
    hidden = torch.cat([no_mask[:, :r], ~visible, no_mask[:, r:]], dim=-1)
    return dense_attention(q, keys, values, F.pad(bias, (r, g)), hidden)


def pale_attention_dense(q, k, v, height, width, pale_size):
    """Parallel PS-Attention over the full map with an explicit membership mask.

    Written from the group rule, pixel pair by pixel pair: for the first half of
    the heads query ``(i, x)`` sees key ``(j, y)`` iff rows ``i`` and ``j`` lie in the
    same interlaced row group, ``i = j (mod ceil(H / s_r))``; for the second half iff
    ``x = y (mod ceil(W / s_c))``. No padding, no gathering: one ``(N, N)`` softmax.

    Args:
        q (Tensor): ``(B, heads, H*W, d)``, already scaled; ``heads`` even.
        k (Tensor): ``(B, heads, H*W, d)``.
        v (Tensor): ``(B, heads, H*W, d)``.
        height (int): Map height ``H``.
        width (int): Map width ``W``.
        pale_size (int | tuple[int, int]): ``s`` or ``(s_r, s_c)``.

    Returns:
        Tensor: ``(B, heads, H*W, d)``.
    """
    s_r, s_c = pale_size_pair(pale_size)
    stride_r, stride_c = -(-height // s_r), -(-width // s_c)
    ys, xs = _pixel_coordinates(height, width)
    same_row_group = (ys[:, None] % stride_r) == (ys[None] % stride_r)
    same_col_group = (xs[:, None] % stride_c) == (xs[None] % stride_c)
    half = q.shape[1] // 2
    hidden = torch.stack([~same_row_group] * half + [~same_col_group] * (q.shape[1] - half))
    return dense_attention(q, k, v, hidden=hidden)
