"""Transformer-LS long-short attention over a 2-D map: segment windows + dynamic projection.

The map is zero-padded at the bottom/right to multiples of the segment size ``w``
and its queries are grouped into non-overlapping ``w x w`` segments. Every query
attends, in ONE softmax (fp32), to

  * the ``r`` projected keys ``K_bar = P k`` of the dynamic projection (the same
    for every query; ``P`` is a softmax over the local tokens, see
    :func:`dynamic_projection`),
  * the ``(w + 2p) x (w + 2p)`` key patch centred on its segment, with
    ``p = max(w // 2, 1)``; keys outside the image -- beyond its borders or in
    the padding -- are hidden, and
  * the keys of the global tokens,

in that order. Patches are gathered per segment (``unfold``), so memory is
``O(N (w + 2p)^2)`` logits, never ``O(N^2)``.

The official code (NVIDIA/transformer-ls, ``AttentionLS``) needs square maps whose
side is a multiple of ``w``; on those maps this computes the same thing. Here any
``H x W`` works: padded keys are hidden in the window branch, and the dynamic
projection is taken over the ``H * W`` real tokens only (the callers pass unpadded
tokens), so padding changes nothing for the real tokens.

Window RPB (official formula, reproduced with its aliasing): query coordinates in
``[0, w)^2`` and key coordinates in ``[-p, p + w)^2`` inside a segment's patch,
``rel = q - k + (p + w - 1)`` per axis, ``index = rel_y * (2p + w) + rel_x``, into a
table of ``2 (w + p - 1)(2p + w + 1) + 1`` rows. The row multiplier ``2p + w`` is
smaller than the ``2(p + w) - 1`` possible column offsets, so different offsets
share rows (w=7: 361 offsets on 253 rows). The formula and the table size are in
:mod:`visattn_mm.ops.rel_pos` (:func:`~visattn_mm.ops.rel_pos.long_short_rpb_index`).
"""

import torch
import torch.nn.functional as F

from ..chunk_gather import chunked_fused_attention
from ..common import chunk_grid, device_cache, from_chunks, run_window_backend, softmax_fp32, to_chunks
from ..impl import attention_path
from ..indexing import segment_pad


@device_cache
def window_key_mask(height, width, window, device):
    """Which keys of each segment's patch lie outside the ``H x W`` image (True = hidden).

    Cached per shape and device.

    Args:
        height (int): Map height ``H``.
        width (int): Map width ``W``.
        window (int): Segment size ``w``.
        device (torch.device): Where the mask is needed.

    Returns:
        BoolTensor: ``(R*C, (w + 2p)**2)`` for the ``R x C`` segment grid (row-major);
        the same for every query of a segment.
    """
    w, p = window, segment_pad(window)
    rows, cols = chunk_grid(height, width, w)
    span = torch.arange(-p, w + p)
    ys = torch.arange(rows)[:, None] * w + span  # (R, K) image rows of each patch
    xs = torch.arange(cols)[:, None] * w + span  # (C, K)
    out_y = (ys < 0) | (ys >= height)
    out_x = (xs < 0) | (xs >= width)
    hidden = out_y[:, None, :, None] | out_x[None, :, None, :]  # (R, C, K, K)
    return hidden.reshape(rows * cols, -1).to(device)


def segment_patches(x, height, width, window):
    """Every segment's ``(w + 2p) x (w + 2p)`` patch of ``x``, zero outside the image.

    Args:
        x (Tensor): ``(B, heads, H*W, d)``, row-major.
        height (int): Map height ``H``.
        width (int): Map width ``W``.
        window (int): Segment size ``w``.

    Returns:
        Tensor: ``(B, heads, R*C, (w + 2p)**2, d)``.
    """
    b, heads, _, d = x.shape
    patches = _segment_patch_view(x, height, width, window)  # (B, h, R, C, d, K, K)
    return patches.permute(0, 1, 2, 3, 5, 6, 4).reshape(b, heads, -1, patches.shape[-1] ** 2, d)


def _segment_patch_view(x, height, width, window):
    """``(B, h, R, C, d, K, K)`` strided view of every segment's patch (see :func:`segment_patches`)."""
    b, heads, _, d = x.shape
    w, p = window, segment_pad(window)
    rows, cols = chunk_grid(height, width, w)
    size = w + 2 * p
    x = x.reshape(b, heads, height, width, d)
    x = F.pad(x, (0, 0, p, cols * w - width + p, p, rows * w - height + p))
    return x.unfold(2, size, w).unfold(3, size, w)


def dynamic_projection(logits, num_heads):
    """The dynamic projection ``P``: a softmax over the tokens, computed in fp32.

    Args:
        logits (Tensor): ``(B, N, heads * r)``, the output of ``to_dynamic_projection``
            on the ``N`` local tokens (no padding); channel ``h * r + j`` is row ``j``
            of head ``h``.
        num_heads (int): Attention heads.

    Returns:
        Tensor: ``(B, heads, r, N)`` in the input dtype; each row sums to 1 over the
        tokens. ``K_bar = P @ k`` and ``V_bar = P @ v`` per head.
    """
    b, n, channels = logits.shape
    if channels % num_heads:
        raise ValueError(f'dynamic projection has {channels} channels, not a multiple of num_heads={num_heads}')
    return softmax_fp32(logits.transpose(1, 2).reshape(b, num_heads, channels // num_heads, n))


def long_short_attention(
    q,
    k,
    v,
    height,
    width,
    window,
    *,
    k_bar=None,
    v_bar=None,
    global_k=None,
    global_v=None,
    local_bias=None,
    dropout_p=0.0,
    impl='auto',
    leading_global=0,
):
    """Local queries attend to ``[projected keys | their segment's patch | global keys]``.

    Args:
        q, k, v (Tensor): ``(B, heads, H*W, d)`` local queries (row-major, already scaled), keys and values.
        height, width (int): Map size ``H x W``.
        window (int): Segment size ``w``.
        k_bar, v_bar (Tensor, optional): ``(B, heads, r, d)`` keys and values of the dynamic projection.
        global_k, global_v (Tensor, optional): ``(B, heads, G, d)`` keys and values of the global tokens.
        local_bias (Tensor, optional): ``(heads, w*w, (w + 2p)**2)`` window RPB, e.g.
            ``table[long_short_rpb_index(w)]`` (:mod:`visattn_mm.ops.rel_pos`) with heads moved first.
        dropout_p (float): Dropout on the attention probabilities.
        impl (str): The path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.
        leading_global (int): ``q``, ``k`` and ``v`` begin with this many global tokens, whose
            keys and values are the global ones (``global_k`` and ``global_v`` must then be None;
            how each path takes them: :func:`~visattn_mm.ops.common.run_window_backend`). Default: 0.

    Returns:
        Tensor: ``(B, heads, H*W, d)``.
    """
    path = attention_path('long_short', q, local_bias, impl=impl, window=window, dropout_p=dropout_p)
    options = dict(k_bar=k_bar, v_bar=v_bar, local_bias=local_bias, dropout_p=dropout_p)
    return run_window_backend(
        _BACKENDS, path, q, k, v, (height, width, window), global_k, global_v, leading_global, options
    )


def _math_long_short_attention(
    q, k, v, height, width, window, *, k_bar, v_bar, global_k, global_v, local_bias, dropout_p
):
    """:func:`long_short_attention` in plain tensor ops: every segment's logits, masked, one softmax."""
    w = window
    q_seg = to_chunks(q, height, width, w)
    b, heads, rows, cols, _, d = q_seg.shape
    q_seg = q_seg.reshape(b, heads, rows * cols, w * w, d)
    k_win = segment_patches(k, height, width, w)
    v_win = segment_patches(v, height, width, w)

    logits = q_seg @ k_win.transpose(-1, -2)  # (B, h, R*C, w*w, K*K)
    if local_bias is not None:
        logits = logits + local_bias[:, None]
    logits = logits.masked_fill(window_key_mask(height, width, w, q.device)[:, None, :], float('-inf'))
    parts = [logits]
    num_bar = 0 if k_bar is None else k_bar.shape[2]
    if num_bar:
        parts.insert(0, q_seg @ k_bar.unsqueeze(2).transpose(-1, -2))
    num_global = 0 if global_k is None else global_k.shape[2]
    if num_global:
        parts.append(q_seg @ global_k.unsqueeze(2).transpose(-1, -2))

    attn = softmax_fp32(torch.cat(parts, dim=-1)).to(v.dtype)
    if dropout_p > 0:
        attn = F.dropout(attn, p=dropout_p, training=True)
    num_win = k_win.shape[3]
    out = attn[..., num_bar : num_bar + num_win] @ v_win
    if num_bar:
        out = out + attn[..., :num_bar] @ v_bar.unsqueeze(2)
    if num_global:
        out = out + attn[..., num_bar + num_win :] @ global_v.unsqueeze(2)
    return from_chunks(out.reshape(b, heads, rows, cols, w * w, d), height, width, w)


def _fused_long_short_attention(
    q,
    k,
    v,
    height,
    width,
    window,
    *,
    k_bar,
    v_bar,
    global_k=None,
    global_v=None,
    leading_global=0,
    local_bias,
    dropout_p,
):
    """:func:`long_short_attention` through :func:`~visattn_mm.ops.chunk_gather.chunked_fused_attention`.

    Per segment, the keys are ``[projected | patch | global]`` (:func:`segment_key_index`);
    keys outside the image are the gather's extra row, the hidden key. The window RPB is
    the same for every segment.
    """
    w = window
    num_bar = 0 if k_bar is None else k_bar.shape[2]
    num_global = leading_global or (0 if global_k is None else global_k.shape[2])
    # Every row is gathered in the queries' dtype, the one the fused kernel computes in
    # (autocast's), so that nothing is gathered in float32 to be cast afterwards.
    keys = [t.to(q.dtype) for t in (k_bar, global_k, k) if t is not None]
    values = [t.to(q.dtype) for t in (v_bar, global_v, v) if t is not None]
    bias = None if local_bias is None else F.pad(local_bias, (num_bar, num_global))
    kv_index = segment_key_index(height, width, w, num_bar, num_global, q.device)
    hidden = None if bias is not None else F.pad(window_key_mask(height, width, w, q.device), (num_bar, num_global))
    return chunked_fused_attention(q, keys, values, height, width, w, kv_index, bias, hidden, dropout_p, leading_global)


def _triton_long_short_attention(*args, **options):
    from .triton import triton_long_short_attention  # Triton is optional: imported when used

    return triton_long_short_attention(*args, **options)


_BACKENDS = dict(math=_math_long_short_attention, fast=_fused_long_short_attention, triton=_triton_long_short_attention)


@device_cache
def segment_key_index(height, width, window, num_bar, num_global, device):
    """Which row each gathered key is, for :class:`~visattn_mm.ops.chunk_gather.ChunkGather`.

    The gather's source rows are the ``r`` projected keys, the ``G`` global tokens, then
    the ``H*W`` map tokens (row-major), then the hidden key. Per segment, the keys are
    ``[projected | patch (row-major) | global]``; patch keys outside the image point to
    the hidden key.

    Returns:
        LongTensor: ``(R*C*(r + (w + 2p)**2 + G),)``.
    """
    w, p = window, segment_pad(window)
    rows, cols = chunk_grid(height, width, w)
    span = torch.arange(-p, w + p)
    ys = (torch.arange(rows)[:, None] * w + span)[:, None, :, None]  # (R, 1, K, 1)
    xs = (torch.arange(cols)[:, None] * w + span)[None, :, None, :]  # (1, C, 1, K)
    first = num_bar + num_global
    patch = torch.where(
        (ys >= 0) & (ys < height) & (xs >= 0) & (xs < width), first + ys * width + xs, first + height * width
    ).reshape(rows * cols, -1)
    bar = torch.arange(num_bar).expand(rows * cols, num_bar)
    glob = torch.arange(num_bar, first).expand(rows * cols, num_global)
    return torch.cat([bar, patch, glob], dim=1).reshape(-1).to(device)
