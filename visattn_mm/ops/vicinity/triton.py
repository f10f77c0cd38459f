"""Vicinity attention (VVT) as Triton kernels (``impl='triton'``), forward and backward.

The same function as :func:`visattn_mm.ops.vicinity.vicinity_attention` (see
there), computed without the ``(B, heads, N, 4d)`` feature tensors and their
elementwise chains. Per (batch, head), with tokens ``i, j``, ``r`` the ReLU,
``w(j)`` the four position weights ``[cos a, sin a, cos b, sin b]`` of token
``j`` (:func:`~visattn_mm.ops.indexing.vicinity_weights`, read in the
accumulation dtype, so the numbers are those of the torch path) and ``C`` the
signed clamp (the identity for ``clamp=False``):

    kf_j = w(j) (x) r(k_j)  (4d; qf_i likewise)
    KV = C(sum_j kf_j^T v_j)  (4d x d),   S = sum_j kf_j  (4d)
    z_i = C(1 / (qf_i . S + eps)),   out_i = C(C(qf_i KV) z_i)

Every kernel runs on a ``(splits, B * heads)`` grid: a program handles one
(batch, head) pair and a range of consecutive tiles of ``BLOCK_N`` tokens, the
splits chosen so that all pairs together make about :data:`PROGRAMS` programs.
A long map (VVT's first stage at detection size: 66800 tokens, with 8 pairs) is
thus cut into ranges of a few dozen tiles, so the sums over ``N`` run on the
whole GPU instead of one block per pair, and every program loads its pair's
``4d x d`` matrices once for all its tiles. A program expands each token tile
into its features in registers, a ``(BLOCK_N, 4 * BLOCK_D)`` tile whose column
``c * BLOCK_D + e`` is ``w_c r(x_e)``, so each product is one ``tl.dot`` of
depth or width ``4 * BLOCK_D``; the ``4d``-wide gradients fold back to ``d``
columns by a weighted sum over the four blocks.

* :func:`_vicinity_sums`: partial sums of ``kf^T v`` and ``kf`` over the
  program's tiles, written to a ``(B * heads, splits, ...)`` buffer that torch
  sums (deterministic, no atomics).
* :func:`_vicinity_forward`: the output rows, from ``KV`` (clamped in the
  kernel) and ``S``.
* :func:`_vicinity_backward_queries`: recomputes the numerators, normalisers
  and clamps, writes the gradient of the queries and partial sums of the
  gradients of ``KV`` and ``S`` (summed by torch).
* :func:`_vicinity_backward_keys`: the gradients of the keys and values, from
  those sums (the clamp's mask on ``KV`` applied in the kernel).

Saved for backward: ``q``, ``k``, ``v`` (as given: strided views stay views)
and the unclamped sums ``(B * heads, 4, d, d)`` and ``(B * heads, 4, d)``;
nothing else per token. The output and the gradients of ``q, k, v`` are
``(B, heads, N, d)`` views of ``(B, N, heads, d)`` storage, so merging the heads
afterwards is free.

Precision: every input is converted to the accumulation dtype when loaded
(fp32; fp64 for fp64 inputs) and all products and sums run in it, also for fp16
and bf16 inputs: the gradient of ``q`` is a small difference of the numerator's
and the normaliser's terms, which 16-bit operands would cost ~15x in precision
(see :mod:`visattn_mm.ops.vicinity`). fp32 products use TF32 only where
``torch.get_float32_matmul_precision()`` is not 'highest'. With ``bf16_products``
(bf16 inputs, opt-in) the six products take operands rounded to bf16, on tensor
cores, as the torch path's option does; everything else stays fp32. Outputs and
gradients are stored in the inputs' dtype. The interpreter: see
:mod:`visattn_mm.ops.triton`.
"""

from typing import NamedTuple  # noqa: I001 (visattn_mm.ops.triton first)

# First, before `import triton`: importing the shared package visattn_mm.ops.triton names the fix where
# triton does not import.
from ..triton import host, kernel_parts as kp

import torch
import triton
import triton.language as tl

from .. import impl
from ..indexing import CLAMP_MAX, CLAMP_MIN, EPS, vicinity_weights

__all__ = ['triton_vicinity_attention']


class _Tile(NamedTuple):
    """The compile-time constants the vicinity kernels read, as one ``tile`` argument.

    Args:
        BLOCK_N (int): Token rows of a tile (:func:`_layout`).
        BLOCK_D (int): Head-dim slots of a tile.
        DOT_PRECISION (str): ``tl.dot``'s input precision (:func:`~visattn_mm.ops.triton.host.dot_precision`).
        CLAMP (bool): Whether the sums, numerators, normalisers and outputs are clamped (the official code's clamp).
        EPS (float): Added to every denominator.
        BF16_PRODUCTS (bool): The six products take bf16-rounded operands (:func:`_product`).
    """

    BLOCK_N: int
    BLOCK_D: int
    DOT_PRECISION: str
    CLAMP: bool
    EPS: float
    BF16_PRODUCTS: bool


# Largest token tile; tests lower it to run the tile loops at tiny sizes. Products are in fp32 (CUDA cores), 8 warps
# a program. With head-dim tiles of 32, tiles of 64 tokens spill registers on sm_90, 32 do not.
MAX_BLOCK_N = 32
# Head-dim tiles of 64 or more (VVT-S's first two stages: head dims 48 and 40) take 16 tokens a tile and 16 warps: with
# 32 and 8 the backward kernels spill 1.3 and 2.3 KB per thread on sm_90, so they spill at most 36 bytes
# (tools/analysis/triton_resources.py).
WIDE_BLOCK_D, WIDE_BLOCK_N, WIDE_WARPS = 64, 16, 16
# Programs the two reduction kernels aim at in all (about 4 per SM of an H100); tests lower it to get
# several splits at tiny sizes.
PROGRAMS = 512
# Below this eps, (1 / eps)^2 may overflow fp32 (or eps is 0), so the rows beyond the map, whose denominator is eps
# alone, get a zero normaliser; only then, since the extra select makes the wide backward kernel spill (76 bytes
# per thread instead of 36 on sm_90).
TINY_EPS = tl.constexpr(1e-15)
# The signed clamp's bounds, as constants the kernels can read.
CLAMP_MIN_BOUND = tl.constexpr(CLAMP_MIN)
CLAMP_MAX_BOUND = tl.constexpr(CLAMP_MAX)


# On a GPU bf16 operands are multiplied as bf16 tiles (tensor cores); Triton's interpreter cannot multiply bf16
# tiles, so there the rounded operands are multiplied in fp32 (the same values, summed in fp32 either way).
BF16_TILES = tl.constexpr(not impl.triton_interpreted())


@triton.jit
def _product(a, b, tile: tl.constexpr):
    """``a @ b`` in the accumulation dtype; with ``tile.BF16_PRODUCTS``, of ``a`` and ``b`` rounded to bf16."""
    if tile.BF16_PRODUCTS:
        a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
        if not BF16_TILES:
            a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=tile.DOT_PRECISION)


@triton.jit
def _signed_clamp(t, CLAMP: tl.constexpr):
    """``sign(t) * clamp(|t|, 1e-4, 1e4)`` where ``CLAMP`` (exact zeros stay zero), else ``t``."""
    if CLAMP:
        # Bounds built in t's dtype: a bare float constant would be rounded to fp32 first.
        low = tl.full(t.shape, CLAMP_MIN_BOUND, t.dtype)
        high = tl.full(t.shape, CLAMP_MAX_BOUND, t.dtype)
        magnitude = tl.minimum(tl.maximum(tl.abs(t), low), high)
        t = tl.where(t > 0, magnitude, tl.where(t < 0, -magnitude, t))
    return t


@triton.jit
def _clamp_passes(t, CLAMP: tl.constexpr):
    """Where :func:`_signed_clamp` passes gradients: ``1e-4 <= |t| <= 1e4`` (everywhere without ``CLAMP``)."""
    if CLAMP:
        magnitude = tl.abs(t)
        return (magnitude >= tl.full(t.shape, CLAMP_MIN_BOUND, t.dtype)) & (
            magnitude <= tl.full(t.shape, CLAMP_MAX_BOUND, t.dtype)
        )
    return tl.full(t.shape, True, tl.int1)


@triton.jit
def _token_rows(t, batch, head, rows, valid, head_dim, acc_dtype, BLOCK_D: tl.constexpr):
    """A ``(BLOCK_N, BLOCK_D)`` tile of the ``(batch, head)`` rows of a ``(B, heads, N, d)`` tensor (a
    :class:`~visattn_mm.ops.triton.host.HeadRows`) in the accumulation dtype, zero where not valid."""
    return kp.load_rows(t, batch, head, rows, valid, head_dim, BLOCK_D).to(acc_dtype)


@triton.jit
def _paired_token_rows(a, b, batch, head, rows, valid, head_dim, acc_dtype, BLOCK_D: tl.constexpr):
    """:func:`_token_rows` of the same rows of two tensors (keys and values; queries and output gradients)."""
    return (
        _token_rows(a, batch, head, rows, valid, head_dim, acc_dtype, BLOCK_D),
        _token_rows(b, batch, head, rows, valid, head_dim, acc_dtype, BLOCK_D),
    )


@triton.jit
def _tile(index, tokens, weights, BLOCK_N: tl.constexpr):
    """The tokens of tile ``index``, whether each is a token of the map, and their ``(BLOCK_N, 4)`` position
    weights (zero beyond the map, so those rows add nothing to any sum)."""
    rows = index * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rows < tokens
    row_weights = tl.load(weights + rows[:, None] * 4 + tl.arange(0, 4)[None, :], mask=valid[:, None], other=0.0)
    return rows, valid, row_weights


@triton.jit
def _features(x, row_weights, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """The ``(BLOCK_N, 4 * BLOCK_D)`` features ``w_c(i) r(x_i)`` of a tile, block ``c`` in columns
    ``c * BLOCK_D ..``."""
    relu = tl.where(x > 0, x, 0.0)
    return tl.reshape(row_weights[:, :, None] * relu[:, None, :], (BLOCK_N, 4 * BLOCK_D))


@triton.jit
def _fold_features(grad_features, x, row_weights, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Gradient of ``x`` from that of its :func:`_features`: ``r'(x) * sum_c w_c * block c``."""
    folded = tl.sum(tl.reshape(grad_features, (BLOCK_N, 4, BLOCK_D)) * row_weights[:, :, None], axis=1)
    return tl.where(x > 0, folded, 0.0)


@triton.jit
def _summary_offsets(head_dim, BLOCK_D: tl.constexpr):
    """Where the rows of a ``(4 * BLOCK_D, BLOCK_D)`` tile of a contiguous ``(4, d, d)`` matrix lie, and those of
    a ``(4 * BLOCK_D,)`` tile of a contiguous ``(4, d)`` vector: ``(matrix offsets, matrix mask, vector
    offsets, vector mask)``; row ``c * BLOCK_D + e`` is row ``e`` of block ``c``."""
    feature = tl.arange(0, 4 * BLOCK_D)
    dim = feature % BLOCK_D
    vector = (feature // BLOCK_D) * head_dim + dim
    vector_mask = dim < head_dim
    cols = tl.arange(0, BLOCK_D)
    matrix = vector[:, None] * head_dim + cols[None, :]
    return matrix, vector_mask[:, None] & (cols < head_dim)[None, :], vector, vector_mask


@triton.jit
def _load_matrix(matrices, batch_head, head_dim, BLOCK_D: tl.constexpr):
    """One pair's ``(4 * BLOCK_D, BLOCK_D)`` tile of a ``(B * heads, 4, d, d)`` tensor, zero in the padding."""
    matrix, matrix_mask, _, _ = _summary_offsets(head_dim, BLOCK_D)
    return tl.load(matrices + batch_head * 4 * head_dim * head_dim + matrix, mask=matrix_mask, other=0.0)


@triton.jit
def _load_vector(vectors, batch_head, head_dim, BLOCK_D: tl.constexpr):
    """One pair's ``(4 * BLOCK_D,)`` tile of a ``(B * heads, 4, d)`` tensor, zero in the padding."""
    _, _, vector, vector_mask = _summary_offsets(head_dim, BLOCK_D)
    return tl.load(vectors + batch_head * 4 * head_dim + vector, mask=vector_mask, other=0.0)


@triton.jit
def _store_summaries(matrices, vectors, part, matrix_tile, vector_tile, head_dim, BLOCK_D: tl.constexpr):
    """Stores row ``part`` of a ``(parts, 4, d, d)`` and a ``(parts, 4, d)`` buffer (the layout of
    :func:`_load_matrix` and :func:`_load_vector`)."""
    matrix, matrix_mask, vector, vector_mask = _summary_offsets(head_dim, BLOCK_D)
    tl.store(matrices + part * 4 * head_dim * head_dim + matrix, matrix_tile, mask=matrix_mask)
    tl.store(vectors + part * 4 * head_dim + vector, vector_tile, mask=vector_mask)


@triton.jit
def _query_terms(queries, row_weights, valid, kv, k_sum, tile: tl.constexpr):
    """A query tile's features, unclamped numerators ``qf KV`` and normalisers ``1 / (qf . S + eps)``."""
    features = _features(queries, row_weights, tile.BLOCK_N, tile.BLOCK_D)
    numerators = _product(features, kv, tile)
    denominators = tl.sum(features * k_sum[None, :], 1) + tl.full([tile.BLOCK_N], tile.EPS, features.dtype)
    normalisers = 1.0 / denominators
    if tile.EPS < TINY_EPS:
        # The denominator of a row beyond the map is eps alone: the backward's 0 * (1 / eps)^2 would be NaN.
        normalisers = tl.where(valid, normalisers, 0.0)
    return features, numerators, normalisers


@triton.jit
def _program_split(heads):
    """This program's ``(split, batch * heads pair, batch, head)`` on a ``(splits, batch * heads)`` grid."""
    batch_head = tl.program_id(1)
    return tl.program_id(0), batch_head, batch_head // heads, batch_head % heads


@triton.jit
def _vicinity_sums(k, v, weights, kv_parts, k_sum_parts, geometry, tile: tl.constexpr):
    """Partial ``sum_j kf_j^T v_j`` and ``sum_j kf_j`` over the split's token tiles, stored as part
    ``batch_head * splits + split`` of the buffers."""
    heads, tokens, head_dim, tiles_per_split = geometry
    split, batch_head, batch, head = _program_split(heads)
    acc_dtype = weights.dtype.element_ty
    kv = tl.zeros([4 * tile.BLOCK_D, tile.BLOCK_D], acc_dtype)
    k_sum = tl.zeros([4 * tile.BLOCK_D], acc_dtype)
    for step in range(tiles_per_split):
        rows, valid, row_weights = _tile(split * tiles_per_split + step, tokens, weights, tile.BLOCK_N)
        keys, values = _paired_token_rows(k, v, batch, head, rows, valid, head_dim, acc_dtype, tile.BLOCK_D)
        features = _features(keys, row_weights, tile.BLOCK_N, tile.BLOCK_D)
        kv += _product(tl.trans(features), values, tile)
        k_sum += tl.sum(features, 0)
    _store_summaries(kv_parts, k_sum_parts, batch_head * tl.num_programs(0) + split, kv, k_sum, head_dim, tile.BLOCK_D)


@triton.jit
def _vicinity_forward(q, weights, kv_raw, k_sum, out, geometry, tile: tl.constexpr):
    """Output rows of the split's token tiles."""
    heads, tokens, head_dim, tiles_per_split = geometry
    split, batch_head, batch, head = _program_split(heads)
    kv = _signed_clamp(_load_matrix(kv_raw, batch_head, head_dim, tile.BLOCK_D), tile.CLAMP)
    pair_k_sum = _load_vector(k_sum, batch_head, head_dim, tile.BLOCK_D)
    for step in range(tiles_per_split):
        rows, valid, row_weights = _tile(split * tiles_per_split + step, tokens, weights, tile.BLOCK_N)
        queries = _token_rows(q, batch, head, rows, valid, head_dim, weights.dtype.element_ty, tile.BLOCK_D)
        _, numerators, normalisers = _query_terms(queries, row_weights, valid, kv, pair_k_sum, tile)
        rows_out = _signed_clamp(
            _signed_clamp(numerators, tile.CLAMP) * _signed_clamp(normalisers, tile.CLAMP)[:, None], tile.CLAMP
        )
        kp.store_rows(out, batch, head, rows, valid, head_dim, rows_out, tile.BLOCK_D)


@triton.jit
def _vicinity_backward_queries(
    q, grad_out, weights, kv_raw, k_sum, grad_q, grad_kv_parts, grad_k_sum_parts, geometry, tile: tl.constexpr
):
    """Gradient of the queries of the split's token tiles, and their partial sums of the gradients of ``KV``
    and ``S``, stored as part ``batch_head * splits + split`` of the buffers."""
    heads, tokens, head_dim, tiles_per_split = geometry
    split, batch_head, batch, head = _program_split(heads)
    acc_dtype = weights.dtype.element_ty
    kv = _signed_clamp(_load_matrix(kv_raw, batch_head, head_dim, tile.BLOCK_D), tile.CLAMP)
    pair_k_sum = _load_vector(k_sum, batch_head, head_dim, tile.BLOCK_D)
    grad_kv = tl.zeros([4 * tile.BLOCK_D, tile.BLOCK_D], acc_dtype)
    grad_k_sum = tl.zeros([4 * tile.BLOCK_D], acc_dtype)
    for step in range(tiles_per_split):
        rows, valid, row_weights = _tile(split * tiles_per_split + step, tokens, weights, tile.BLOCK_N)
        queries, grad_rows = _paired_token_rows(
            q, grad_out, batch, head, rows, valid, head_dim, acc_dtype, tile.BLOCK_D
        )
        features, numerators, normalisers = _query_terms(queries, row_weights, valid, kv, pair_k_sum, tile)
        clamped_numerators = _signed_clamp(numerators, tile.CLAMP)
        clamped_normalisers = _signed_clamp(normalisers, tile.CLAMP)
        grad_rows = tl.where(
            _clamp_passes(clamped_numerators * clamped_normalisers[:, None], tile.CLAMP), grad_rows, 0.0
        )
        grad_numerators = tl.where(_clamp_passes(numerators, tile.CLAMP), grad_rows * clamped_normalisers[:, None], 0.0)
        grad_normalisers = tl.where(
            _clamp_passes(normalisers, tile.CLAMP), tl.sum(grad_rows * clamped_numerators, 1), 0.0
        )
        # d(1 / den) / d den = -(1 / den)^2; rows beyond the map have a zero gradient here.
        grad_denominators = -grad_normalisers * normalisers * normalisers
        grad_features = _product(grad_numerators, tl.trans(kv), tile) + grad_denominators[:, None] * pair_k_sum[None, :]
        kp.store_rows(
            grad_q,
            batch,
            head,
            rows,
            valid,
            head_dim,
            _fold_features(grad_features, queries, row_weights, tile.BLOCK_N, tile.BLOCK_D),
            tile.BLOCK_D,
        )
        grad_kv += _product(tl.trans(features), grad_numerators, tile)
        grad_k_sum += tl.sum(grad_denominators[:, None] * features, 0)
    _store_summaries(
        grad_kv_parts,
        grad_k_sum_parts,
        batch_head * tl.num_programs(0) + split,
        grad_kv,
        grad_k_sum,
        head_dim,
        tile.BLOCK_D,
    )


@triton.jit
def _vicinity_backward_keys(k, v, weights, kv_raw, grad_kv, grad_k_sum, grad_k, grad_v, geometry, tile: tl.constexpr):
    """Gradients of the keys and values of the split's token tiles from the summed gradients of ``KV`` (before
    its clamp's mask) and ``S``."""
    heads, tokens, head_dim, tiles_per_split = geometry
    split, batch_head, batch, head = _program_split(heads)
    acc_dtype = weights.dtype.element_ty
    pair_grad_kv = tl.where(
        _clamp_passes(_load_matrix(kv_raw, batch_head, head_dim, tile.BLOCK_D), tile.CLAMP),
        _load_matrix(grad_kv, batch_head, head_dim, tile.BLOCK_D),
        0.0,
    )
    pair_grad_k_sum = _load_vector(grad_k_sum, batch_head, head_dim, tile.BLOCK_D)
    for step in range(tiles_per_split):
        rows, valid, row_weights = _tile(split * tiles_per_split + step, tokens, weights, tile.BLOCK_N)
        keys, values = _paired_token_rows(k, v, batch, head, rows, valid, head_dim, acc_dtype, tile.BLOCK_D)
        grad_features = _product(values, tl.trans(pair_grad_kv), tile) + pair_grad_k_sum[None, :]
        kp.store_rows(
            grad_k,
            batch,
            head,
            rows,
            valid,
            head_dim,
            _fold_features(grad_features, keys, row_weights, tile.BLOCK_N, tile.BLOCK_D),
            tile.BLOCK_D,
        )
        grad_values = _product(_features(keys, row_weights, tile.BLOCK_N, tile.BLOCK_D), pair_grad_kv, tile)
        kp.store_rows(grad_v, batch, head, rows, valid, head_dim, grad_values, tile.BLOCK_D)


def _layout(batch_heads, tokens, max_block):
    """Token tile side, splits and tiles per split of the kernels' ``(splits, batch * heads)`` grids: about
    :data:`PROGRAMS` programs in all, each over a range of consecutive tiles of at most ``max_block`` tokens."""
    block = min(max_block, host.tile(tokens))
    tiles = triton.cdiv(tokens, block)
    tiles_per_split = triton.cdiv(tiles * batch_heads, PROGRAMS)
    return block, triton.cdiv(tiles, tiles_per_split), tiles_per_split


def _launch_setup(q, height, width, eps, clamp, bf16_products):
    """Position weights, grid, launch settings, geometry argument and ``tile`` bundle of the four kernels."""
    batch, heads, tokens, head_dim = q.shape
    pairs = batch * heads
    acc_dtype = host.acc_dtype(q.dtype)
    block_d = host.tile(head_dim)
    wide = block_d >= WIDE_BLOCK_D
    block, splits, tiles_per_split = _layout(pairs, tokens, min(MAX_BLOCK_N, WIDE_BLOCK_N) if wide else MAX_BLOCK_N)
    # bf16 products: 16-bit operands, for which tl.dot's precision is host.dot_precision's of 16-bit inputs.
    precision = host.dot_precision(torch.bfloat16 if bf16_products else acc_dtype)
    tile = _Tile(block, block_d, precision, clamp, eps, bf16_products)
    return (
        vicinity_weights(height, width, q.device, acc_dtype),
        (splits, pairs),
        dict(num_warps=WIDE_WARPS if wide else 8),
        (heads, tokens, head_dim, tiles_per_split),
        host.constant_bundle(tile),
    )


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    height: int,
    width: int,
    eps: float,
    clamp: bool,
    bf16_products: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output and the unclamped sums ``KV`` ``(B * heads, 4, d, d)`` and ``S`` ``(B * heads, 4, d)``."""
    weights, grid, settings, geometry, tile = _launch_setup(q, height, width, eps, clamp, bf16_products)
    kv_parts = weights.new_empty(grid[1], grid[0], 4, q.shape[-1], q.shape[-1])
    k_sum_parts = weights.new_empty(grid[1], grid[0], 4, q.shape[-1])
    host.launch(
        _vicinity_sums,
        grid,
        settings,
        host.head_rows(k),
        host.head_rows(v),
        weights,
        kv_parts,
        k_sum_parts,
        geometry,
        tile=tile,
    )
    kv_raw, k_sum = kv_parts.sum(1), k_sum_parts.sum(1)

    out = host.like_heads_last(q)
    host.launch(
        _vicinity_forward,
        grid,
        settings,
        host.head_rows(q),
        weights,
        kv_raw,
        k_sum,
        host.head_rows(out),
        geometry,
        tile=tile,
    )
    return out, kv_raw, k_sum


def _forward_fake(q, k, v, height, width, eps, clamp, bf16_products):
    batch, heads, _, head_dim = q.shape
    sums = q.new_empty(batch * heads, 4, head_dim, dtype=host.acc_dtype(q.dtype))
    return host.like_heads_last(q), sums.new_empty(*sums.shape, head_dim), sums


def _backward(grad_out, q, k, v, out, kv_raw, k_sum, height, width, eps, clamp, bf16_products, needs_grad):
    """The gradients of ``q, k, v`` (``out`` is not needed: the numerators are recomputed)."""
    weights, grid, settings, geometry, tile = _launch_setup(q, height, width, eps, clamp, bf16_products)
    grad_q, grad_k, grad_v = host.like_heads_last(q), host.like_heads_last(k), host.like_heads_last(v)
    grad_kv_parts = kv_raw.new_empty(grid[1], grid[0], *kv_raw.shape[1:])
    grad_k_sum_parts = k_sum.new_empty(grid[1], grid[0], *k_sum.shape[1:])
    host.launch(
        _vicinity_backward_queries,
        grid,
        settings,
        host.head_rows(q),
        host.head_rows(grad_out),
        weights,
        kv_raw,
        k_sum,
        host.head_rows(grad_q),
        grad_kv_parts,
        grad_k_sum_parts,
        geometry,
        tile=tile,
    )
    host.launch(
        _vicinity_backward_keys,
        grid,
        settings,
        host.head_rows(k),
        host.head_rows(v),
        weights,
        kv_raw,
        grad_kv_parts.sum(1),
        grad_k_sum_parts.sum(1),
        host.head_rows(grad_k),
        host.head_rows(grad_v),
        geometry,
        tile=tile,
    )
    return host.gradient_list([grad_q, grad_k, grad_v], (q, k, v), needs_grad)


_vicinity_op = host.define_op('triton_vicinity_attention', _forward, _backward, host.QKV, forward_fake=_forward_fake)


def triton_vicinity_attention(q, k, v, height, width, eps=EPS, clamp=True, bf16_products=False):
    """:func:`~visattn_mm.ops.vicinity.vicinity_attention` through the Triton kernels.

    Arguments as there (no ``recompute``: only ``q``, ``k``, ``v`` and the small
    sums are kept for backward anyway). Inputs may be strided views; the output
    and the gradients of ``q, k, v`` are ``(B, heads, H*W, d)`` views of
    ``(B, H*W, heads, d)`` storage, so merging the heads afterwards is free.
    ``k`` and ``v`` are cast to ``q``'s dtype; everything is computed in fp32
    (fp64 for fp64 inputs), except that for bf16 inputs ``bf16_products=True`` rounds the
    operands of the six matrix products to bf16 (tensor cores on a GPU; sums in fp32), as
    the torch path's option does (its errors: :mod:`visattn_mm.ops.vicinity`).

    Raises:
        ValueError: For ``q``, ``k``, ``v`` that are not 4-D tensors of one shape,
            a token count other than ``height * width``, or a head dim the kernels'
            shared memory cannot hold (:class:`~visattn_mm.ops.specs.TritonLimits`): use impl 'math' then.
        RuntimeError: For tensors that are not on a CUDA device, unless Triton's
            interpreter is on (``TRITON_INTERPRET=1`` before the kernels are imported).
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f'q, k and v must be (B, heads, N, d) tensors of one shape, got {tuple(q.shape)}, '
            f'{tuple(k.shape)} and {tuple(v.shape)}'
        )
    host.check_supported('vicinity', q, height * width)
    k, v = k.to(q.dtype), v.to(q.dtype)
    host.check_device(q)
    bf16_products = bool(bf16_products) and q.dtype == torch.bfloat16
    return _vicinity_op(q, k, v, height, width, float(eps), bool(clamp), bf16_products)[0]
