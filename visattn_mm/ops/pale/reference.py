"""The float64 reference of pale-shaped attention (Pale Transformer) (tests, small maps only)."""

import torch

from ..common import dense_attention
from ..indexing import pale_size_pair
from ..reference import pixel_coordinates

__all__ = ['pale_attention_dense']


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
    ys, xs = pixel_coordinates(height, width)
    same_row_group = (ys[:, None] % stride_r) == (ys[None] % stride_r)
    same_col_group = (xs[:, None] % stride_c) == (xs[None] % stride_c)
    half = q.shape[1] // 2
    hidden = torch.stack([~same_row_group] * half + [~same_col_group] * (q.shape[1] - half))
    return dense_attention(q, k, v, hidden=hidden)
