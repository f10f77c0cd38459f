"""Vicinity attention (VVT): linear attention with a 2-D Manhattan locality weight.

For a token ``t`` of an ``H x W`` map (row-major) the positions are
``a = (pi/2) * (t // W) / H`` and ``b = (pi/2) * (t % W) / W``, recomputed for
the current map size. Queries and keys go through the ReLU kernel and are
re-weighted into ``4d`` features

    q' = [q cos a, q sin a, q cos b, q sin b]     (k' likewise),

so that ``q'_i . k'_j = (q_i . k_j) (cos(a_i - a_j) + cos(b_i - b_j))``. The
attention is then computed linearly in the number of tokens N:

    KV = k'^T v            (4d x d per head)
    Z  = 1 / (q' . sum_j k'_j + eps)
    out = (q' KV) * Z

Like the official code, a signed clamp ``sign(t) * clamp(|t|, 1e-4, 1e4)`` (exact
zeros stay zero) is applied after KV, after Z, after ``q' KV`` and after the
multiplication by Z; the attention layer adds it after ``out_proj`` and after the
feature-preserving gate (:func:`preserve_features`).

KV, Z and the products are computed in at least fp32 with autocast disabled:
under fp16/bf16 autocast the sums over all tokens of a detection-sized map
would otherwise overflow or lose precision. Nothing of size ``N x N`` is built:
the largest intermediates are the ``(B, heads, N, 4d)`` features, and in training
only ``q``, ``k`` and ``v`` are kept for backward (the rest is recomputed there).
"""
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CLAMP_MIN = 1e-4
CLAMP_MAX = 1e4
EPS = 1e-4  # added to the normaliser's denominator (official value)


def signed_clamp(t, min_mag=CLAMP_MIN, max_mag=CLAMP_MAX):
    """``sign(t) * clamp(|t|, min_mag, max_mag)``: magnitudes forced into a range.

    Exact zeros stay zero (their sign is 0); tiny non-zero values become
    ``+-min_mag`` and huge ones ``+-max_mag``. The gradient is 1 inside the range
    and 0 outside it, as with the official in-place version.
    """
    return t.sign() * t.abs().clamp(min_mag, max_mag)


def _maybe_clamp(t, clamp):
    return signed_clamp(t) if clamp else t


def vicinity_positions(height, width, device=None, dtype=torch.float32):
    """Row and column angles ``(a, b)`` of the ``H*W`` tokens, each of shape ``(N,)``.

    ``a = (pi/2) * row / H`` and ``b = (pi/2) * col / W`` for token ``t = row * W + col``;
    both lie in ``[0, pi/2)``, so all cosines and sines are non-negative.
    """
    index = torch.arange(height * width, device=device, dtype=torch.float64)
    rows, cols = torch.div(index, width, rounding_mode='floor'), torch.remainder(index, width)
    a = (math.pi / 2) * rows / height
    b = (math.pi / 2) * cols / width
    return a.to(dtype), b.to(dtype)


def vicinity_features(x, a, b):
    """Re-weight kernel features ``x`` (``(..., N, d)``) into ``(..., N, 4d)``.

    Order of the four blocks (as in the official code): ``x cos a``, ``x sin a``,
    ``x cos b``, ``x sin b``.
    """
    a, b = a[:, None], b[:, None]
    return torch.cat([x * torch.cos(a), x * torch.sin(a), x * torch.cos(b), x * torch.sin(b)], dim=-1)


def vicinity_attention(q, k, v, height, width, eps=EPS, clamp=True, recompute=True):
    """Linear vicinity attention of one map.

    Args:
        q (Tensor): ``(B, heads, N, d)`` query projections, before the ReLU kernel.
        k (Tensor): ``(B, heads, N, d)`` key projections, before the ReLU kernel.
        v (Tensor): ``(B, heads, N, d)`` values.
        height (int): Map height ``H``.
        width (int): Map width ``W``; ``N`` must equal ``H * W`` (row-major tokens).
        eps (float): Added to the normaliser's denominator. Default: 1e-4.
        clamp (bool): Apply the official signed clamps (after KV, Z, ``q' KV`` and
            the multiplication by Z). Default: True.
        recompute (bool): When a gradient is needed, keep only ``q``, ``k``, ``v``
            for backward and recompute the fp32 ``4d``-wide features there, instead
            of storing about a dozen ``(B, heads, N, 4d)`` fp32 intermediates
            (same numbers; one more cheap elementwise forward in backward).
            Default: True.

    Returns:
        Tensor: ``(B, heads, N, d)`` in the dtype of ``q``.
    """
    n = q.shape[-2]
    if n != height * width:
        raise ValueError(f'vicinity_attention: {n} tokens do not form a {height}x{width} map')
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if recompute and needs_grad:
        return checkpoint(_vicinity_attention, q, k, v, height, width, eps, clamp, use_reentrant=False)
    return _vicinity_attention(q, k, v, height, width, eps, clamp)


def _vicinity_attention(q, k, v, height, width, eps, clamp):
    out_dtype = q.dtype
    compute = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(device_type=q.device.type, enabled=False):
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        a, b = vicinity_positions(height, width, q.device, compute)
        qf = vicinity_features(F.relu(q), a, b)                     # (B, h, N, 4d)
        kf = vicinity_features(F.relu(k), a, b)
        kv = _maybe_clamp(kf.transpose(-1, -2) @ v, clamp)          # (B, h, 4d, d)
        k_sum = kf.sum(dim=-2)                                      # (B, h, 4d)
        z = 1.0 / ((qf @ k_sum[..., None]).squeeze(-1) + eps)       # (B, h, N)
        z = _maybe_clamp(z, clamp)
        out = _maybe_clamp(qf @ kv, clamp)                          # (B, h, N, d)
        out = _maybe_clamp(out * z[..., None], clamp)
    return out.to(out_dtype)


def preserve_features(out, gate, clamp=True):
    """Feature Preserving Connection: ``out + out * gate``, then the signed clamp.

    Args:
        out (Tensor): ``(B, N, C)`` attention output after ``out_proj`` (and its clamp).
        gate (Tensor): ``(B, C)`` sigmoid gate computed from the token mean.
        clamp (bool): Apply the signed clamp to the result. Default: True.
    """
    return _maybe_clamp(out + out * gate[:, None, :], clamp)
