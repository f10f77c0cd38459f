"""Numerics and chunk layout shared by the attention ops."""

import functools

import torch
import torch.nn.functional as F

from .process_state import STATE

# Sizes that are symbols while torch.export traces with dynamic shapes.
SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def device_cache(build):
    """Caches ``build``'s constant tensors (masks, indices, weights) per argument tuple (size, device, ...).

    So that a forward pass neither rebuilds them nor copies them to the device. They
    are built outside inference mode, so that autograd can save them later, also when
    the first call came from under :func:`torch.inference_mode`. The results are
    shared: do not modify them. :func:`clear_device_caches` empties every such cache.
    """

    @functools.lru_cache(maxsize=64)
    def cached(*args, **kwargs):
        with torch.inference_mode(False):
            return build(*args, **kwargs)

    @functools.wraps(build)
    def lookup(*args, **kwargs):
        # While torch.export or torch.compile traces, tensors are fake (a cached one would poison
        # later eager calls) and sizes may be symbols: build in the graph.
        if builds_for_every_size(*args, *kwargs.values()):
            return build(*args, **kwargs)
        return cached(*args, **kwargs)

    lookup.cache_clear = cached.cache_clear
    lookup.cache_info = cached.cache_info
    STATE.device_caches.append(lookup)
    return lookup


def is_symbolic(*values):
    """Whether any of ``values`` is a symbolic size (torch.export tracing with dynamic shapes).

    Code that skips work for some sizes (no padding needed, nothing to mask) must take
    the general branch for a symbol: the exported graph serves every size.
    """
    return any(isinstance(value, SYMBOLIC_TYPES) for value in values)


def builds_for_every_size(*values):
    """Whether the graph being traced must serve other sizes than ``values``' own.

    So under torch.export with dynamic shapes (the sizes are symbols) and under torch.compile
    (dynamo shows them as plain ints, yet makes them dynamic once a second size comes). Code that
    skips work for some sizes must take the general branch then: under torch.compile a branch on
    a size is a guard, and a new compilation whenever it flips.
    """
    return torch.compiler.is_compiling() or is_symbolic(*values)


def storage_key(tensor):
    """An id of the memory ``tensor`` views, the same for every view of it (fake tensors included)."""
    return tensor.untyped_storage()._cdata


def clear_device_caches():
    """Drops every constant cached by :func:`device_cache` (frees their device memory)."""
    STATE.clear_device_caches()


def softmax_fp32(logits, dim=-1):
    """Softmax computed in at least fp32, returned in the input dtype.

    Half-precision logits (fp16/bf16 autocast) overflow or lose the -inf masks'
    neighbours; fp64 stays fp64 so reference comparisons are exact.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        return logits.softmax(dim=dim, dtype=torch.float32).to(logits.dtype)
    return logits.softmax(dim=dim)


# Logit added to keys hidden through an extra feature column (see
# :func:`fused_attention`): exp(-1e4) is exactly 0 in fp16/bf16/fp32 softmax,
# yet finite, so the gradient through the column stays 0 instead of 0 * inf.
HIDDEN_KEY_LOGIT = -1e4


def fused_attention(q, k, v, bias=None, hidden=None, dropout_p=0.0):
    """``softmax(q k^T + bias, key mask) v`` through ``scaled_dot_product_attention``.

    The fused kernels (flash on CPU, flash / memory-efficient on CUDA)
    accumulate in fp32 and keep only a log-sum-exp per query for backward,
    never the ``L x S`` scores. PyTorch picks its explicit math kernel instead
    (same result) when the bias requires grad or dropout is on (CPU).

    A bias shared by all groups combined with a mask that differs per group
    would need a materialised ``(N, h, L, S)`` float mask -- as large as the
    scores. Instead the mask is folded into the dot product: queries get an
    extra feature 1, keys ``0`` or :data:`HIDDEN_KEY_LOGIT` (values get a 0
    feature to keep the head dims equal, as the fused kernels require). All
    three are then zero-padded to a head dim that is a multiple of 8.

    Numerics under fp16/bf16 (autocast): the explicit path rounds the logits
    and the fp32 softmax to the input dtype before ``@ v``; the fused kernels
    keep scores, softmax and accumulation in fp32 and round only the output.
    The two agree to the input dtype's precision (about 1e-2 relative in bf16).

    Args:
        q (Tensor): ``(N, h, L, d)`` queries, already scaled.
        k (Tensor): ``(N, h, S, d)`` keys.
        v (Tensor): ``(N, h, S, d)`` values.
        bias (Tensor, optional): ``(h, L, S)`` logit bias shared by the N groups.
        hidden (BoolTensor, optional): broadcastable to ``(N, h, 1, S)``,
            True where a key is hidden from every query.
        dropout_p (float): Dropout on the attention probabilities.

    Returns:
        Tensor: ``(N, h, L, d)``.
    """
    head_dim = v.shape[-1]
    mask = None if bias is None else bias.to(q.dtype)
    if hidden is not None and mask is None:
        mask = ~hidden
    elif hidden is not None:
        key_logit = torch.zeros(hidden.shape, dtype=k.dtype, device=k.device)
        key_logit = key_logit.masked_fill(hidden, HIDDEN_KEY_LOGIT).transpose(-1, -2)
        # Pad the head dim to a multiple of 8 that the fused CUDA kernels require.
        extra = 8 - head_dim % 8
        q = torch.cat([q, F.pad(torch.ones_like(q[..., :1]), (0, extra - 1))], dim=-1)
        k = torch.cat([k, F.pad(key_logit.expand(*k.shape[:-1], 1), (0, extra - 1))], dim=-1)
        v = F.pad(v, (0, extra))
    if mask is not None:
        # A mask with fewer dims than q makes PyTorch (2.12, CPU) skip the fused kernel.
        mask = mask.reshape((1,) * (q.dim() - mask.dim()) + tuple(mask.shape))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=1.0)[..., :head_dim]
    if torch.compiler.is_exporting():
        # The traced kernel's output is heads-last in memory, its decomposition (for ONNX) is
        # not: one fixed layout keeps the callers' reshapes valid views in both graphs.
        out = out.contiguous()
    return out


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
        attn = F.dropout(attn, p=dropout_p, training=True)
    return attn @ v


def split_leading(tokens, count):
    """``(tokens[:, :, :count], tokens[:, :, count:])`` of ``(B, heads, n, d)`` tokens, as one split.

    Views, as slices are; but backward joins the two gradients with one copy, where two
    slices each make a zero-filled full-size gradient and then add them.
    """
    return tokens.split([count, tokens.shape[2] - count], dim=2)


def run_window_backend(backends, path, q, k, v, geometry, global_k, global_v, leading_global, options):
    """Runs a window op (sliding-chunk, long-short) on its chosen path, with or without leading globals.

    The op's public function validates and picks ``path``; this is the one place that hands its
    arguments to the path's backend, ``backends[path](q, k, v, *geometry, global_k=..., global_v=...,
    **options)``. With ``leading_global`` tokens in ``q``, ``k`` and ``v`` (the global tokens, whose
    keys and values are the global ones), the fused backend gathers from the whole tensors, so that
    their gradients need no slicing backward; the other backends get them split, as one split
    (:func:`split_leading`) per tensor.

    Raises:
        ValueError: For ``global_k`` or ``global_v`` given beside ``leading_global`` tokens.
    """
    if leading_global:
        if global_k is not None or global_v is not None:
            raise ValueError(
                'leading_global: the global keys and values are the leading tokens; global_k and global_v must be None'
            )
        if path == 'fast':
            return backends['fast'](q, k, v, *geometry, leading_global=leading_global, **options)
        (_, q), (global_k, k), (global_v, v) = (split_leading(t, leading_global) for t in (q, k, v))
    return backends[path](q, k, v, *geometry, global_k=global_k, global_v=global_v, **options)


def chunk_grid(height, width, window):
    """Rows and columns ``(R, C)`` of ``w x w`` chunks covering an ``H x W`` map (the last ones padded)."""
    return -(-height // window), -(-width // window)


def to_chunks(x, height, width, window):
    """Cut row-major map tokens into ``w x w`` chunks, zero-padding the map at the bottom/right.

    ViL's sliding chunks and Transformer-LS' segments share this layout.

    Args:
        x (Tensor): ``(B, heads, H*W, d)`` tokens of an ``H x W`` map, row-major.
        height (int): Map height ``H``.
        width (int): Map width ``W``.
        window (int): Chunk size ``w``.

    Returns:
        Tensor: ``(B, heads, R, C, w*w, d)`` for the ``R x C`` grid of :func:`chunk_grid`;
        the tokens of each chunk row-major.
    """
    b, heads, _, d = x.shape
    w = window
    rows, cols = chunk_grid(height, width, w)
    x = x.reshape(b, heads, height, width, d)
    x = F.pad(x, (0, 0, 0, cols * w - width, 0, rows * w - height))
    x = x.reshape(b, heads, rows, w, cols, w, d).transpose(3, 4)
    return x.reshape(b, heads, rows, cols, w * w, d)


def from_chunks(x, height, width, window):
    """Inverse of :func:`to_chunks`: chunks back to row-major map tokens, the padding cropped.

    Args:
        x (Tensor): ``(B, heads, R, C, w*w, d)``.
        height (int): Map height ``H``.
        width (int): Map width ``W``.
        window (int): Chunk size ``w``.

    Returns:
        Tensor: ``(B, heads, H*W, d)``.
    """
    b, heads, rows, cols, _, d = x.shape
    w = window
    x = x.reshape(b, heads, rows, cols, w, w, d).transpose(3, 4)
    if builds_for_every_size(*x.shape, height, width):
        # A gather is a new tensor whether or not anything is cropped, where a view's layout
        # would depend on it (and dynamo and AOTAutograd guard on layouts).
        x = x.clone(memory_format=torch.contiguous_format).view(b, heads, rows * w * cols * w, d)
        kept = torch.arange(height, device=x.device)[:, None] * (cols * w) + torch.arange(width, device=x.device)
        return x.index_select(2, kept.view(-1))
    x = x.reshape(b, heads, rows * w, cols * w, d)[:, :, :height, :width]
    return x.reshape(b, heads, height * width, d)
