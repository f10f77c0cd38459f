"""Sliding-chunk attention as fused Triton kernels (``impl='triton'``), forward and backward.

The same function as :func:`visattn_mm.ops.sliding_chunk.sliding_chunk_attention`
(see there for the masking and shift modes), computed without gathering
neighbours or storing logits. One program handles one ``w x w`` chunk of one
(batch, head) pair; chunk slot ``s`` is the token ``(s // w, s % w)`` of the
chunk, so the zero padding of the map is never materialised: padded slots are
masked loads.

* Forward: online softmax (FlashAttention style) over the global keys and the
  shift mode's neighbour chunks of the query chunk; the masks (outside the
  image, outside the chunk grid, the exact window of masking mode 1) are
  computed from chunk coordinates. Saves one log-sum-exp per query.
* Backward (FlashAttention-2 style, probabilities recomputed from the
  log-sum-exp): a query-centric kernel writes the gradient of the queries,
  per-chunk partial gradients of the global keys / values / local->global bias
  (summed afterwards) and adds the gradient of the local bias with atomics; a
  key-centric kernel then loops over the query chunks that see its key chunk
  and writes the gradients of the local keys and values.

Accumulation is in fp32 (fp64 for fp64 inputs); matmul inputs are the tensors'
dtype, the probabilities are rounded to it before ``@ v`` as in FlashAttention.
fp32 products use TF32 only where ``torch.get_float32_matmul_precision()`` is not
'highest' (as PyTorch's matmuls). The gradient of the local bias is summed with
atomics over all chunks and the batch, so its last bits may vary from run to
run (and the contention on it is the first suspect once GPU timings exist).

Dropout is not supported: ``dropout_p > 0`` raises a ValueError (choose
``impl='fast'`` or ``'math'`` for attention dropout).

The kernels run on CUDA tensors. Triton's interpreter runs them on CPU tensors
(float64 included) when ``TRITON_INTERPRET=1`` is in the environment before this
module is imported (tests). One tile covers a chunk (``next_pow2(w*w)`` slots,
64 for the default ``w = 7``); windows much larger than 11 will spill registers.
"""
import collections

import torch

try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(f"attention impl 'triton' needs the triton package, which does not import here ({error}). "
                      "Install the triton version that matches your PyTorch (`pip install triton`; Linux CUDA "
                      "builds of PyTorch bring it), or choose impl 'fast' or 'math'.") from error

from .common import chunk_grid
from .sliding_chunk import check_modes, neighbour_blocks

# Launches per kernel name since import (tests use it to prove this path ran).
KERNEL_LAUNCHES = collections.Counter()

# Smallest tile side: tl.dot needs at least 16 rows, columns and depth on GPUs.
MIN_TILE = 16


@triton.jit
def _chunk_tokens(chunk_row, chunk_col, height, width, WINDOW: tl.constexpr, BLOCK: tl.constexpr):
    """Row-major token index of each chunk slot, and whether the slot is a token of the map."""
    slots = tl.arange(0, BLOCK)
    y = chunk_row * WINDOW + slots // WINDOW
    x = chunk_col * WINDOW + slots % WINDOW
    valid = (slots < WINDOW * WINDOW) & (y < height) & (x < width)
    return y * width + x, valid


@triton.jit
def _load_rows(base, rows, valid, stride_row, stride_dim, head_dim, BLOCK_D: tl.constexpr):
    """``(len(rows), BLOCK_D)`` tile of a ``(..., rows, head_dim)`` tensor, zero where not valid."""
    dims = tl.arange(0, BLOCK_D)
    pointers = base + rows[:, None] * stride_row + dims[None, :] * stride_dim
    return tl.load(pointers, mask=valid[:, None] & (dims < head_dim)[None, :], other=0.0)


@triton.jit
def _store_rows(base, rows, valid, stride_row, stride_dim, head_dim, tile, BLOCK_D: tl.constexpr):
    """Store ``tile`` where :func:`_load_rows` would load it, in the tensor's dtype."""
    dims = tl.arange(0, BLOCK_D)
    pointers = base + rows[:, None] * stride_row + dims[None, :] * stride_dim
    tl.store(pointers, tile.to(base.dtype.element_ty), mask=valid[:, None] & (dims < head_dim)[None, :])


@triton.jit
def _neighbour_block(step, NUM_BLOCKS: tl.constexpr, SECOND_BLOCK: tl.constexpr):
    """Index into ``NEIGHBOUR_OFFSETS`` of the ``step``-th key chunk of the shift mode.

    All 9 blocks in order, or the own chunk (4) followed by ``SECOND_BLOCK``.
    """
    block = step
    if NUM_BLOCKS != 9:
        block = 4 + (SECOND_BLOCK - 4) * step
    return block


@triton.jit
def _neighbour_chunk(chunk_row, chunk_col, block, rows, cols):
    """The key chunk that ``block`` reaches from a query chunk, wrapped around the grid, and
    whether it lies inside the grid unwrapped (``NEIGHBOUR_OFFSETS[b] = (b // 3 - 1, b % 3 - 1)``)."""
    raw_row = chunk_row + block // 3 - 1
    raw_col = chunk_col + block % 3 - 1
    in_grid = (raw_row >= 0) & (raw_row < rows) & (raw_col >= 0) & (raw_col < cols)
    return (raw_row + rows) % rows, (raw_col + cols) % cols, in_grid


@triton.jit
def _mask_local_scores(scores, query_slots, key_slots, key_valid, bias_base, bias_stride_q, bias_stride_k, block,
                       in_grid, MASKING_MODE: tl.constexpr, HAS_LOCAL_BIAS: tl.constexpr, WINDOW: tl.constexpr):
    """Adds the local bias to the dot products of a query chunk and one neighbour chunk, and
    sets hidden logits to ``-inf``.

    Works on either orientation: ``query_slots``, ``key_slots`` and ``key_valid``
    are broadcast along the tile's query and key axes (``[:, None]`` and
    ``[None, :]`` for ``(queries, keys)`` tiles, the reverse for transposed ones).

    Returns:
        The logits and the visibility mask (which broadcasts against them; it
        depends on the key only in masking modes 0 / -1).
    """
    if HAS_LOCAL_BIAS:
        in_chunk = (query_slots < WINDOW * WINDOW) & (key_slots < WINDOW * WINDOW)
        pointers = bias_base + query_slots * bias_stride_q + (block * WINDOW * WINDOW + key_slots) * bias_stride_k
        scores += tl.load(pointers, mask=in_chunk, other=0.0).to(scores.dtype)
    visible = key_valid
    if MASKING_MODE != -1:
        visible = visible & in_grid
    if MASKING_MODE == 1:
        # Exact window: query and key offsets from the query chunk's corner differ by at most w.
        rel_y = query_slots // WINDOW - ((block // 3 - 1) * WINDOW + key_slots // WINDOW)
        rel_x = query_slots % WINDOW - ((block % 3 - 1) * WINDOW + key_slots % WINDOW)
        visible = visible & (tl.abs(rel_y) <= WINDOW) & (tl.abs(rel_x) <= WINDOW)
    return tl.where(visible, scores, float('-inf')), visible


@triton.jit
def _global_scores(queries, global_keys, l2g_base, l2g_stride, HAS_L2G_BIAS: tl.constexpr,
                   NUM_GLOBAL: tl.constexpr, BLOCK_G: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Logits of a query chunk against the global keys, ``-inf`` in the padding slots."""
    scores = tl.dot(queries, tl.trans(global_keys), input_precision=DOT_PRECISION)
    slots = tl.arange(0, BLOCK_G)
    if HAS_L2G_BIAS:
        scores += tl.load(l2g_base + slots * l2g_stride, mask=slots < NUM_GLOBAL, other=0.0).to(scores.dtype)[None, :]
    return tl.where((slots < NUM_GLOBAL)[None, :], scores, float('-inf'))


@triton.jit
def _softmax_step(row_max, row_sum, acc, scores, values, DOT_PRECISION: tl.constexpr):
    """One online-softmax update with a tile of logits and its values."""
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    # Rows with every logit hidden so far keep a finite reference (exp(-inf - 0) = 0).
    reference = tl.where(new_max == float('-inf'), 0.0, new_max)
    rescale = tl.exp(row_max - reference)
    probs = tl.exp(scores - reference[:, None])
    row_sum = row_sum * rescale + tl.sum(probs, 1)
    acc = acc * rescale[:, None] + tl.dot(probs.to(values.dtype), values, input_precision=DOT_PRECISION)
    return new_max, row_sum, acc


@triton.jit
def _sliding_chunk_forward(
        q, k, v, global_k, global_v, local_bias, l2g_bias, out, lse,
        q_sb, q_sh, q_sn, q_sd, k_sb, k_sh, k_sn, k_sd, v_sb, v_sh, v_sn, v_sd,
        gk_sb, gk_sh, gk_sn, gk_sd, gv_sb, gv_sh, gv_sn, gv_sd, o_sb, o_sh, o_sn, o_sd,
        bias_sh, bias_sq, bias_sk, l2g_sh, l2g_sg,
        heads, height, width, rows, cols, head_dim,
        WINDOW: tl.constexpr, MASKING_MODE: tl.constexpr, NUM_BLOCKS: tl.constexpr, SECOND_BLOCK: tl.constexpr,
        NUM_GLOBAL: tl.constexpr, HAS_LOCAL_BIAS: tl.constexpr, HAS_L2G_BIAS: tl.constexpr,
        BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Output and log-sum-exp of one query chunk; grid ``(rows * cols, batch * heads)``."""
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    row, col = chunk // cols, chunk % cols
    acc_dtype = lse.dtype.element_ty
    tokens, query_valid = _chunk_tokens(row, col, height, width, WINDOW, BLOCK)
    queries = _load_rows(q + batch * q_sb + head * q_sh, tokens, query_valid, q_sn, q_sd, head_dim, BLOCK_D)

    row_max = tl.full([BLOCK], float('-inf'), acc_dtype)
    row_sum = tl.zeros([BLOCK], acc_dtype)
    acc = tl.zeros([BLOCK, BLOCK_D], acc_dtype)
    if NUM_GLOBAL > 0:
        global_slots = tl.arange(0, BLOCK_G)
        global_valid = global_slots < NUM_GLOBAL
        global_keys = _load_rows(global_k + batch * gk_sb + head * gk_sh, global_slots, global_valid,
                                 gk_sn, gk_sd, head_dim, BLOCK_D)
        global_values = _load_rows(global_v + batch * gv_sb + head * gv_sh, global_slots, global_valid,
                                   gv_sn, gv_sd, head_dim, BLOCK_D)
        global_scores = _global_scores(queries, global_keys, l2g_bias + head * l2g_sh, l2g_sg, HAS_L2G_BIAS,
                                       NUM_GLOBAL, BLOCK_G, DOT_PRECISION)
        row_max, row_sum, acc = _softmax_step(row_max, row_sum, acc, global_scores, global_values, DOT_PRECISION)

    slots = tl.arange(0, BLOCK)
    for step in range(NUM_BLOCKS):
        block = _neighbour_block(step, NUM_BLOCKS, SECOND_BLOCK)
        key_row, key_col, in_grid = _neighbour_chunk(row, col, block, rows, cols)
        key_tokens, key_valid = _chunk_tokens(key_row, key_col, height, width, WINDOW, BLOCK)
        keys = _load_rows(k + batch * k_sb + head * k_sh, key_tokens, key_valid, k_sn, k_sd, head_dim, BLOCK_D)
        values = _load_rows(v + batch * v_sb + head * v_sh, key_tokens, key_valid, v_sn, v_sd, head_dim, BLOCK_D)
        scores = tl.dot(queries, tl.trans(keys), input_precision=DOT_PRECISION)
        scores, _ = _mask_local_scores(scores, slots[:, None], slots[None, :], key_valid[None, :],
                                       local_bias + head * bias_sh, bias_sq, bias_sk, block, in_grid,
                                       MASKING_MODE, HAS_LOCAL_BIAS, WINDOW)
        row_max, row_sum, acc = _softmax_step(row_max, row_sum, acc, scores, values, DOT_PRECISION)

    # Every real query sees its own token; the guard only keeps padding slots finite.
    row_sum = tl.where(row_sum == 0, 1.0, row_sum)
    _store_rows(out + batch * o_sb + head * o_sh, tokens, query_valid, o_sn, o_sd, head_dim,
                acc / row_sum[:, None], BLOCK_D)
    tl.store(lse + batch_head * height * width + tokens, row_max + tl.log(row_sum), mask=query_valid)


@triton.jit
def _sliding_chunk_backward_queries(
        q, k, v, global_k, global_v, local_bias, l2g_bias, out, grad_out, lse, delta,
        grad_q, grad_local_bias, grad_global_k, grad_global_v, grad_l2g,
        q_sb, q_sh, q_sn, q_sd, k_sb, k_sh, k_sn, k_sd, v_sb, v_sh, v_sn, v_sd,
        gk_sb, gk_sh, gk_sn, gk_sd, gv_sb, gv_sh, gv_sn, gv_sd, o_sb, o_sh, o_sn, o_sd,
        do_sb, do_sh, do_sn, do_sd, dq_sb, dq_sh, dq_sn, dq_sd,
        bias_sh, bias_sq, bias_sk, l2g_sh, l2g_sg,
        heads, height, width, rows, cols, head_dim,
        WINDOW: tl.constexpr, MASKING_MODE: tl.constexpr, NUM_BLOCKS: tl.constexpr, SECOND_BLOCK: tl.constexpr,
        NUM_GLOBAL: tl.constexpr, HAS_LOCAL_BIAS: tl.constexpr, HAS_L2G_BIAS: tl.constexpr,
        LOCAL_BIAS_GRAD: tl.constexpr,
        BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Gradients seen from one query chunk; grid ``(rows * cols, batch * heads)``.

    Writes ``delta = rowsum(dO * O)`` of the chunk's queries (read by
    :func:`_sliding_chunk_backward_keys`), their gradient, this chunk's partial
    sums of the global gradients (``grad_global_k / grad_global_v``:
    ``(batch * heads, rows * cols, NUM_GLOBAL, head_dim)``, ``grad_l2g``:
    ``(batch * heads, rows * cols, NUM_GLOBAL)``), and adds its logit gradients
    to ``grad_local_bias`` (``(heads, w*w, 9*w*w)``, contiguous).
    """
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    row, col = chunk // cols, chunk % cols
    acc_dtype = lse.dtype.element_ty
    tokens, query_valid = _chunk_tokens(row, col, height, width, WINDOW, BLOCK)
    queries = _load_rows(q + batch * q_sb + head * q_sh, tokens, query_valid, q_sn, q_sd, head_dim, BLOCK_D)
    grad_rows = _load_rows(grad_out + batch * do_sb + head * do_sh, tokens, query_valid, do_sn, do_sd,
                           head_dim, BLOCK_D)
    outputs = _load_rows(out + batch * o_sb + head * o_sh, tokens, query_valid, o_sn, o_sd, head_dim, BLOCK_D)
    row_delta = tl.sum(grad_rows.to(acc_dtype) * outputs.to(acc_dtype), 1)
    tl.store(delta + batch_head * height * width + tokens, row_delta, mask=query_valid)
    row_lse = tl.load(lse + batch_head * height * width + tokens, mask=query_valid, other=0.0)
    grad_queries = tl.zeros([BLOCK, BLOCK_D], acc_dtype)

    if NUM_GLOBAL > 0:
        global_slots = tl.arange(0, BLOCK_G)
        global_valid = global_slots < NUM_GLOBAL
        global_keys = _load_rows(global_k + batch * gk_sb + head * gk_sh, global_slots, global_valid,
                                 gk_sn, gk_sd, head_dim, BLOCK_D)
        global_values = _load_rows(global_v + batch * gv_sb + head * gv_sh, global_slots, global_valid,
                                   gv_sn, gv_sd, head_dim, BLOCK_D)
        global_scores = _global_scores(queries, global_keys, l2g_bias + head * l2g_sh, l2g_sg, HAS_L2G_BIAS,
                                       NUM_GLOBAL, BLOCK_G, DOT_PRECISION)
        global_probs = tl.where(query_valid[:, None], tl.exp(global_scores - row_lse[:, None]), 0.0)
        global_grad_probs = tl.dot(grad_rows, tl.trans(global_values), input_precision=DOT_PRECISION)
        global_grad_scores = global_probs * (global_grad_probs - row_delta[:, None])
        grad_queries += tl.dot(global_grad_scores.to(global_keys.dtype), global_keys, input_precision=DOT_PRECISION)
        part = batch_head * rows * cols + chunk
        dims = tl.arange(0, BLOCK_D)
        part_offsets = (part * NUM_GLOBAL + global_slots)[:, None] * head_dim + dims[None, :]
        part_mask = global_valid[:, None] & (dims < head_dim)[None, :]
        tl.store(grad_global_k + part_offsets, tl.dot(tl.trans(global_grad_scores.to(queries.dtype)), queries,
                                                      input_precision=DOT_PRECISION), mask=part_mask)
        tl.store(grad_global_v + part_offsets, tl.dot(tl.trans(global_probs.to(grad_rows.dtype)), grad_rows,
                                                      input_precision=DOT_PRECISION), mask=part_mask)
        if HAS_L2G_BIAS:
            tl.store(grad_l2g + part * NUM_GLOBAL + global_slots, tl.sum(global_grad_scores, 0), mask=global_valid)

    slots = tl.arange(0, BLOCK)
    for step in range(NUM_BLOCKS):
        block = _neighbour_block(step, NUM_BLOCKS, SECOND_BLOCK)
        key_row, key_col, in_grid = _neighbour_chunk(row, col, block, rows, cols)
        key_tokens, key_valid = _chunk_tokens(key_row, key_col, height, width, WINDOW, BLOCK)
        keys = _load_rows(k + batch * k_sb + head * k_sh, key_tokens, key_valid, k_sn, k_sd, head_dim, BLOCK_D)
        values = _load_rows(v + batch * v_sb + head * v_sh, key_tokens, key_valid, v_sn, v_sd, head_dim, BLOCK_D)
        scores = tl.dot(queries, tl.trans(keys), input_precision=DOT_PRECISION)
        scores, visible = _mask_local_scores(scores, slots[:, None], slots[None, :], key_valid[None, :],
                                             local_bias + head * bias_sh, bias_sq, bias_sk, block, in_grid,
                                             MASKING_MODE, HAS_LOCAL_BIAS, WINDOW)
        probs = tl.where(query_valid[:, None], tl.exp(scores - row_lse[:, None]), 0.0)
        grad_probs = tl.dot(grad_rows, tl.trans(values), input_precision=DOT_PRECISION)
        grad_scores = probs * (grad_probs - row_delta[:, None])
        grad_queries += tl.dot(grad_scores.to(keys.dtype), keys, input_precision=DOT_PRECISION)
        if LOCAL_BIAS_GRAD:
            chunk_area = WINDOW * WINDOW
            pointers = (grad_local_bias + head * chunk_area * 9 * chunk_area + slots[:, None] * 9 * chunk_area
                        + (block * chunk_area + slots)[None, :])
            tl.atomic_add(pointers, grad_scores, mask=query_valid[:, None] & visible, sem='relaxed')

    _store_rows(grad_q + batch * dq_sb + head * dq_sh, tokens, query_valid, dq_sn, dq_sd, head_dim,
                grad_queries, BLOCK_D)


@triton.jit
def _sliding_chunk_backward_keys(
        q, k, v, local_bias, grad_out, lse, delta, grad_k, grad_v,
        q_sb, q_sh, q_sn, q_sd, k_sb, k_sh, k_sn, k_sd, v_sb, v_sh, v_sn, v_sd,
        do_sb, do_sh, do_sn, do_sd, dk_sb, dk_sh, dk_sn, dk_sd, dv_sb, dv_sh, dv_sn, dv_sd,
        bias_sh, bias_sq, bias_sk,
        heads, height, width, rows, cols, head_dim,
        WINDOW: tl.constexpr, MASKING_MODE: tl.constexpr, NUM_BLOCKS: tl.constexpr, SECOND_BLOCK: tl.constexpr,
        HAS_LOCAL_BIAS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Gradients of one key chunk's keys and values; grid ``(rows * cols, batch * heads)``.

    A key chunk is block ``b`` of exactly one query chunk per ``b`` (the offset
    taken back, wrapped), so this loops over the same (query chunk, block)
    pairs as the forward pass.
    """
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch, head = batch_head // heads, batch_head % heads
    key_row, key_col = chunk // cols, chunk % cols
    acc_dtype = lse.dtype.element_ty
    key_tokens, key_valid = _chunk_tokens(key_row, key_col, height, width, WINDOW, BLOCK)
    keys = _load_rows(k + batch * k_sb + head * k_sh, key_tokens, key_valid, k_sn, k_sd, head_dim, BLOCK_D)
    values = _load_rows(v + batch * v_sb + head * v_sh, key_tokens, key_valid, v_sn, v_sd, head_dim, BLOCK_D)
    grad_keys = tl.zeros([BLOCK, BLOCK_D], acc_dtype)
    grad_values = tl.zeros([BLOCK, BLOCK_D], acc_dtype)

    slots = tl.arange(0, BLOCK)
    for step in range(NUM_BLOCKS):
        block = _neighbour_block(step, NUM_BLOCKS, SECOND_BLOCK)
        row = (key_row - (block // 3 - 1) + rows) % rows
        col = (key_col - (block % 3 - 1) + cols) % cols
        _, _, in_grid = _neighbour_chunk(row, col, block, rows, cols)
        tokens, query_valid = _chunk_tokens(row, col, height, width, WINDOW, BLOCK)
        queries = _load_rows(q + batch * q_sb + head * q_sh, tokens, query_valid, q_sn, q_sd, head_dim, BLOCK_D)
        grad_rows = _load_rows(grad_out + batch * do_sb + head * do_sh, tokens, query_valid, do_sn, do_sd,
                               head_dim, BLOCK_D)
        row_lse = tl.load(lse + batch_head * height * width + tokens, mask=query_valid, other=0.0)
        row_delta = tl.load(delta + batch_head * height * width + tokens, mask=query_valid, other=0.0)
        # (keys, queries) tiles: the products below then need no transposed register tile.
        scores = tl.dot(keys, tl.trans(queries), input_precision=DOT_PRECISION)
        scores, _ = _mask_local_scores(scores, slots[None, :], slots[:, None], key_valid[:, None],
                                       local_bias + head * bias_sh, bias_sq, bias_sk, block, in_grid,
                                       MASKING_MODE, HAS_LOCAL_BIAS, WINDOW)
        probs = tl.where(query_valid[None, :], tl.exp(scores - row_lse[None, :]), 0.0)
        grad_values += tl.dot(probs.to(grad_rows.dtype), grad_rows, input_precision=DOT_PRECISION)
        grad_probs = tl.dot(values, tl.trans(grad_rows), input_precision=DOT_PRECISION)
        grad_scores = probs * (grad_probs - row_delta[None, :])
        grad_keys += tl.dot(grad_scores.to(queries.dtype), queries, input_precision=DOT_PRECISION)

    _store_rows(grad_k + batch * dk_sb + head * dk_sh, key_tokens, key_valid, dk_sn, dk_sd, head_dim,
                grad_keys, BLOCK_D)
    _store_rows(grad_v + batch * dv_sb + head * dv_sh, key_tokens, key_valid, dv_sn, dv_sd, head_dim,
                grad_values, BLOCK_D)


# Any JITFunction subclass compiles; the interpreter's stand-in is not one.
INTERPRETED = not isinstance(_sliding_chunk_forward, triton.runtime.JITFunction)


def _launch(kernel, grid, num_warps, *args, **constexprs):
    """Counts and launches ``kernel`` (tests replace this to compile without a GPU)."""
    KERNEL_LAUNCHES[kernel.fn.__name__] += 1
    kernel[grid](*args, num_warps=num_warps, **constexprs)


def _or(tensor, stand_in):
    """``tensor``, or ``stand_in`` as the pointer argument of an absent one (its kernel branch is compiled out)."""
    return stand_in if tensor is None else tensor


def _dot_precision(dtype):
    """tl.dot's input precision: fp32 products in TF32 only where PyTorch's matmuls may use it
    (``torch.set_float32_matmul_precision``); 16-bit inputs ignore it."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != 'highest':
        return 'tf32'
    return 'ieee' if dtype in (torch.float32, torch.float64) else 'tf32'


def _num_warps(dtype):
    """Warps per program: 4 for 16-bit inputs (tensor-core tiles); 8 otherwise, where full-precision
    products run on CUDA cores and 4 warps spill registers (sm_90, compiled without a GPU to measure)."""
    return 4 if dtype.itemsize == 2 else 8


def _tile(size):
    return max(MIN_TILE, triton.next_power_of_2(size))


def _strides(tensor, ndim):
    """The tensor's strides, or zeros for an absent tensor (its kernel branch is compiled out)."""
    return tuple(tensor.stride()) if tensor is not None else (0, ) * ndim


def _like_heads_last(t):
    """An empty ``(B, h, N, d)`` tensor stored as ``(B, N, h, d)``: the layout the heads are merged from."""
    b, heads, n, d = t.shape
    return t.new_empty(b, n, heads, d).transpose(1, 2)


class _SlidingChunkAttention(torch.autograd.Function):
    """Autograd node of :func:`triton_sliding_chunk_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, global_k, global_v, local_bias, l2g_bias, geometry):
        height, width, window, masking_mode, shift_mode = geometry
        batch, heads, _, head_dim = q.shape
        rows, cols = chunk_grid(height, width, window)
        blocks = neighbour_blocks(shift_mode)
        num_global = 0 if global_k is None else global_k.shape[2]
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        constexprs = dict(
            WINDOW=window, MASKING_MODE=masking_mode, NUM_BLOCKS=len(blocks), SECOND_BLOCK=blocks[-1],
            HAS_LOCAL_BIAS=local_bias is not None, BLOCK=_tile(window * window), BLOCK_D=_tile(head_dim),
            DOT_PRECISION=_dot_precision(q.dtype))
        global_constexprs = dict(NUM_GLOBAL=num_global, HAS_L2G_BIAS=l2g_bias is not None,
                                 BLOCK_G=_tile(num_global))
        shape = (heads, height, width, rows, cols, head_dim)
        grid = (rows * cols, batch * heads)

        out = _like_heads_last(q)
        lse = torch.empty(batch * heads, height * width, dtype=acc_dtype, device=q.device)
        _launch(_sliding_chunk_forward, grid, _num_warps(q.dtype),
                q, k, v, _or(global_k, q), _or(global_v, q), _or(local_bias, q), _or(l2g_bias, q), out, lse,
                *q.stride(), *k.stride(), *v.stride(), *_strides(global_k, 4), *_strides(global_v, 4),
                *out.stride(), *_strides(local_bias, 3), *_strides(l2g_bias, 2), *shape,
                **constexprs, **global_constexprs)
        ctx.save_for_backward(q, k, v, global_k, global_v, local_bias, l2g_bias, out, lse)
        ctx.launch = (grid, shape, constexprs, global_constexprs)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, global_k, global_v, local_bias, l2g_bias, out, lse = ctx.saved_tensors
        grid, shape, constexprs, global_constexprs = ctx.launch
        heads, _, _, rows, cols, head_dim = shape
        batch = q.shape[0]
        num_global = global_constexprs['NUM_GLOBAL']
        grad_out = grad_out.to(q.dtype)
        grad_q, grad_k, grad_v = _like_heads_last(q), _like_heads_last(k), _like_heads_last(v)
        delta = torch.empty_like(lse)
        local_bias_grad = local_bias is not None and ctx.needs_input_grad[5]
        grad_local_bias = None
        if local_bias_grad:
            grad_local_bias = torch.zeros(local_bias.shape, dtype=lse.dtype, device=q.device)
        parts = batch * heads, rows * cols, num_global
        grad_global_k = grad_global_v = grad_l2g = None
        if num_global:
            grad_global_k = lse.new_empty(*parts, head_dim)
            grad_global_v = lse.new_empty(*parts, head_dim)
            if l2g_bias is not None:
                grad_l2g = lse.new_empty(parts)

        _launch(_sliding_chunk_backward_queries, grid, _num_warps(q.dtype),
                q, k, v, _or(global_k, q), _or(global_v, q), _or(local_bias, q), _or(l2g_bias, q), out, grad_out,
                lse, delta, grad_q, _or(grad_local_bias, lse), _or(grad_global_k, lse), _or(grad_global_v, lse),
                _or(grad_l2g, lse),
                *q.stride(), *k.stride(), *v.stride(), *_strides(global_k, 4), *_strides(global_v, 4),
                *out.stride(), *grad_out.stride(), *grad_q.stride(), *_strides(local_bias, 3),
                *_strides(l2g_bias, 2), *shape,
                LOCAL_BIAS_GRAD=local_bias_grad, **constexprs, **global_constexprs)
        _launch(_sliding_chunk_backward_keys, grid, _num_warps(q.dtype),
                q, k, v, _or(local_bias, q), grad_out, lse, delta, grad_k, grad_v,
                *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *grad_k.stride(), *grad_v.stride(),
                *_strides(local_bias, 3), *shape, **constexprs)

        def finished(grad, like):
            return None if grad is None else grad.to(like.dtype)

        if num_global:
            grad_global_k = grad_global_k.sum(1).reshape(global_k.shape)
            grad_global_v = grad_global_v.sum(1).reshape(global_v.shape)
            if grad_l2g is not None:
                grad_l2g = grad_l2g.reshape(batch, heads, rows * cols, num_global).sum((0, 2))
        return (grad_q, grad_k, grad_v, finished(grad_global_k, global_k), finished(grad_global_v, global_v),
                finished(grad_local_bias, local_bias), finished(grad_l2g, l2g_bias), None)


def triton_sliding_chunk_attention(q, k, v, height, width, window, *, global_k=None, global_v=None,
                                   local_bias=None, l2g_bias=None, masking_mode=0, shift_mode=0, dropout_p=0.0):
    """:func:`~visattn_mm.ops.sliding_chunk.sliding_chunk_attention` through the Triton kernels.

    Arguments as there. Inputs may be strided views; the output and the
    gradients of ``q, k, v`` are ``(B, heads, H*W, d)`` views of
    ``(B, H*W, heads, d)`` storage, so merging the heads afterwards is free.
    The other inputs are cast to ``q``'s dtype; the biases keep theirs.

    Raises:
        ValueError: For ``dropout_p > 0`` (not supported here; use impl 'fast'
            or 'math'), an unsupported mode combination, a token count other than
            ``height * width``, or global keys without global values (or the reverse).
        RuntimeError: For tensors that are not on a CUDA device, unless Triton's
            interpreter is on (``TRITON_INTERPRET=1`` before this module is imported).
    """
    if dropout_p > 0:
        raise ValueError(f"impl 'triton' does not support attention dropout (dropout_p={dropout_p}); "
                         "use impl 'fast' or 'math' with dropout, or set the attention dropout to 0")
    check_modes(masking_mode, shift_mode)
    if q.shape[2] != height * width:
        raise ValueError(f'q has {q.shape[2]} tokens, not height * width = {height} * {width}')
    if (global_k is None) != (global_v is None):
        raise ValueError('global_k and global_v must be given together')
    if q.device.type != 'cuda' and not INTERPRETED:
        raise RuntimeError(f"impl 'triton' runs on CUDA tensors, got {q.device.type} ones; use impl 'fast' or "
                           "'math' there (TRITON_INTERPRET=1 set before visattn_mm.ops.triton_sliding_chunk is "
                           'imported runs the kernels on the CPU, slowly, for tests)')
    k, v = k.to(q.dtype), v.to(q.dtype)
    if global_k is None or global_k.shape[2] == 0:
        global_k = global_v = l2g_bias = None
    else:
        global_k, global_v = global_k.to(q.dtype), global_v.to(q.dtype)
    geometry = (height, width, window, masking_mode, shift_mode)
    return _SlidingChunkAttention.apply(q, k, v, global_k, global_v, local_bias, l2g_bias, geometry)
