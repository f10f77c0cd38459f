"""The float64 reference of sliding chunk attention (ViL) (tests, small maps only)."""

import torch

from ..common import chunk_grid, dense_attention
from ..indexing import NEIGHBOUR_OFFSETS, check_modes, neighbour_blocks
from ..reference import pixel_coordinates
from ..rel_pos import sliding_chunk_rpb_row

__all__ = ['sliding_chunk_visibility', 'sliding_chunk_attention_dense']


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
    ys, xs = pixel_coordinates(height, width)
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
