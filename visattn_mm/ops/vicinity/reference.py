"""The float64 reference of vicinity attention (VVT) (tests, small maps only)."""

import torch

from ..indexing import EPS
from . import signed_clamp

__all__ = ['vicinity_attention_dense']


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
