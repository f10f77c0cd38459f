"""Naive dense attention: the reference every fast path is tested against.

These build the full ``N x N`` logit matrix with an explicit bias and mask.
They are exact and simple, and quadratic in memory: use them for tests and for
small maps only.
"""
import torch

from .common import softmax_fp32
from .rel_pos import NEIGHBOUR_OFFSETS
from .sliding_chunk import check_modes, neighbour_blocks


def dense_attention(q, k, v, bias=None, hidden=None, dropout_p=0.0):
    """softmax(q k^T + bias, masked) v with the softmax in fp32.

    Args:
        q (Tensor): ``(..., Nq, d)``, already scaled.
        k (Tensor): ``(..., Nk, d)``.
        v (Tensor): ``(..., Nk, d)``.
        bias (Tensor, optional): broadcastable to ``(..., Nq, Nk)``.
        hidden (BoolTensor, optional): True where a key is hidden from a query.
        dropout_p (float): Dropout on the attention probabilities.
    """
    logits = q @ k.transpose(-1, -2)
    if bias is not None:
        logits = logits + bias
    if hidden is not None:
        logits = logits.masked_fill(hidden, float('-inf'))
    attn = softmax_fp32(logits).to(v.dtype)
    if dropout_p > 0:
        attn = torch.nn.functional.dropout(attn, p=dropout_p, training=True)
    return attn @ v


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
    rows, cols = -(-height // w), -(-width // w)
    if masking_mode == -1 and (rows < 3 or cols < 3):
        raise ValueError('the dense reference of cyclic mode needs at least 3 chunks per axis')
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing='ij')
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    chunk_dy = ys[None] // w - ys[:, None] // w           # key chunk - query chunk
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
