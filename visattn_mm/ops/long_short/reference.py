"""The float64 reference of long-short attention (ViL) (tests, small maps only)."""

import torch
import torch.nn.functional as F

from ..common import dense_attention
from ..indexing import segment_pad
from ..reference import pixel_coordinates
from ..rel_pos import long_short_rpb_row

__all__ = ['long_short_attention_dense']


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
    ys, xs = pixel_coordinates(height, width)
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
