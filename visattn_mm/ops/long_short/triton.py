"""Transformer-LS long-short attention as Triton kernels (``impl='triton'``), forward and backward.

The same function as :func:`visattn_mm.ops.long_short.long_short_attention` (see
there and :func:`visattn_mm.ops.long_short.reference.long_short_attention_dense`), computed
without gathering patches or storing logits. One program handles one ``w x w``
segment of one (batch, head) pair; segment slot ``s`` is the token
``(s // w, s % w)`` of the segment, so the zero padding of the map is never
materialised: padded slots are masked loads.

* Forward: online softmax (FlashAttention style) over the ``r`` projected keys,
  the segment's ``(w + 2p)^2`` key patch (``p = segment_pad(w)``) in tiles of as
  many keys as the query tile has slots, and the global keys. Patch keys outside
  the image are masked from their coordinates; the window RPB is added to the
  patch logits only. Saves one log-sum-exp per query.
* Backward (FlashAttention-2 style, probabilities recomputed from the
  log-sum-exp): a query-centric kernel writes the gradient of the queries,
  per-segment partial gradients of the projected and global keys and values
  (summed afterwards) and adds the gradient of the window RPB with atomics; a
  key-centric kernel then loops over the 3 x 3 segments around its key chunk
  (``p <= w``: no patch reaches farther) and writes the gradients of the local
  keys and values.

Numerics and dtypes: see :mod:`visattn_mm.ops.triton.kernel_parts`; the interpreter:
see :mod:`visattn_mm.ops.triton`. The gradient of the window RPB is summed with
atomics over all segments and the batch (spread over copies, see
:func:`~visattn_mm.ops.triton.kernel_parts.add_bias_grad`), so its last bits may
vary from run to run; under ``torch.use_deterministic_algorithms`` a third backward
kernel sums it without atomics (:func:`~visattn_mm.ops.triton.host.bias_grad_parts`).

Cost: the patch tiles hold ``ceil((w + 2p)^2 / B)`` tiles of ``B = next_pow2(w*w)``
keys (3 x 64 for ``w = 7``: 88% used); the key-centric kernel computes 9 tiles of
``B x B`` logits per key chunk, of which the patches use ``((w + 2p) / 3w)^2``
(38% for ``w = 7``) -- the first suspect once GPU timings exist.

Dropout is not supported: ``dropout_p > 0`` raises a ValueError (choose
``impl='fast'`` or ``'math'`` for attention dropout).
"""

from typing import NamedTuple, Optional  # noqa: I001 (visattn_mm.ops.triton first)

# First, before `import triton`: importing the shared package visattn_mm.ops.triton names the fix where
# triton does not import.
from ..triton import host, kernel_parts as kp

import torch
import triton
import triton.language as tl

from ..common import chunk_grid
from ..indexing import segment_pad

__all__ = ['triton_long_short_attention']


class _Tile(NamedTuple):
    """The compile-time constants every long-short kernel and its helpers read, as one ``tile`` argument
    (one place to add one).

    Args:
        WINDOW (int): The segment size ``w``.
        PAD (int): The patch's margin ``p`` around a segment (:func:`~visattn_mm.ops.indexing.segment_pad`).
        HAS_LOCAL_BIAS (bool): Whether there is a window RPB.
        BLOCK (int): Token slots of a tile (:func:`~visattn_mm.ops.triton.host.tile` of ``w*w``).
        BLOCK_D (int): Head-dim slots of a tile.
        DOT_PRECISION (str): ``tl.dot``'s input precision (:func:`~visattn_mm.ops.triton.host.dot_precision`).
    """

    WINDOW: int
    PAD: int
    HAS_LOCAL_BIAS: bool
    BLOCK: int
    BLOCK_D: int
    DOT_PRECISION: str


class _Inputs(NamedTuple):
    """The op's tensor inputs (the custom op's leading arguments; ``host.define_op``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_bar: Optional[torch.Tensor]
    v_bar: Optional[torch.Tensor]
    global_k: Optional[torch.Tensor]
    global_v: Optional[torch.Tensor]
    local_bias: Optional[torch.Tensor]


class _Shared(NamedTuple):
    """The compile-time constants of the shared keys (projected and global), which the forward and the
    query-side backward kernel read, as one ``shared`` argument.

    Args:
        BAR (SharedKeys): The ``r`` projected keys (:class:`~visattn_mm.ops.triton.host.SharedKeys`; no bias).
        GLOBAL (SharedKeys): The ``G`` global keys (no bias).
    """

    BAR: host.SharedKeys
    GLOBAL: host.SharedKeys


@triton.jit
def _window_logits(scores, query_slots, patch_slots, visible, local_bias, head, tile: tl.constexpr):
    """Adds the window RPB (a :class:`~visattn_mm.ops.triton.host.BiasTable`) to the dot products of a
    segment's queries and patch keys, and sets hidden logits to ``-inf``.

    Works on either orientation: ``query_slots``, ``patch_slots`` and ``visible``
    are broadcast along the tile's query and key axes (``[:, None]`` and
    ``[None, :]`` for ``(queries, keys)`` tiles, the reverse for transposed ones).
    A visible key lies in the patch, so its patch slot indexes the RPB.
    """
    if tile.HAS_LOCAL_BIAS:
        # The patch slot is the key's column in the gathered bias: the key order of rel_pos.long_short_rpb_index.
        base = local_bias.ptr + head * local_bias.head
        pointers = base + query_slots * local_bias.query + patch_slots * local_bias.key
        scores += tl.load(pointers, mask=visible & (query_slots < tile.WINDOW * tile.WINDOW), other=0.0).to(
            scores.dtype
        )
    return tl.where(visible, scores, float('-inf'))


@triton.jit
def _patch_tile(queries, start, k, v, local_bias, batch, head, segment_row, segment_col, geometry, tile: tl.constexpr):
    """Slots ``start .. start + BLOCK`` of a segment's row-major key patch against its queries: the loop body
    of the forward and the query-side backward kernel.

    Returns:
        The patch slots, whether each is a pixel of the image (hidden otherwise),
        the keys and values, and the ``(queries, keys)`` tile of logits.
    """
    _, height, width, _, head_dim = geometry
    span = tile.WINDOW + 2 * tile.PAD
    patch_slots = start + tl.arange(0, tile.BLOCK)
    y = segment_row * tile.WINDOW - tile.PAD + patch_slots // span
    x = segment_col * tile.WINDOW - tile.PAD + patch_slots % span
    key_valid = (patch_slots < span * span) & (y >= 0) & (y < height) & (x >= 0) & (x < width)
    keys, values, scores = kp.key_tile(
        queries, k, v, batch, head, y * width + x, key_valid, head_dim, tile.BLOCK_D, tile.DOT_PRECISION
    )
    scores = _window_logits(
        scores, tl.arange(0, tile.BLOCK)[:, None], patch_slots[None, :], key_valid[None, :], local_bias, head, tile
    )
    return patch_slots, key_valid, keys, values, scores


@triton.jit
def _long_short_forward(inputs, out, lse, geometry, tile: tl.constexpr, shared: tl.constexpr):
    """Output and log-sum-exp of one segment's queries; grid ``(rows * cols, batch * heads)``.

    The shared keys have no bias: they get ``local_bias`` as their unread bias argument.
    """
    q, k, v, k_bar, v_bar, global_k, global_v, local_bias = inputs
    heads, height, width, cols, head_dim = geometry
    segment, batch_head, batch, head, row, col = kp.program_chunk(heads, cols)
    tokens, query_valid = kp.chunk_tokens(row, col, height, width, tile.WINDOW, tile.BLOCK)
    queries = kp.load_rows(q, batch, head, tokens, query_valid, head_dim, tile.BLOCK_D)

    row_max, row_sum, acc = kp.softmax_start(lse, tile.BLOCK, tile.BLOCK_D)
    if shared.BAR.NUM > 0:
        bar_set = (k_bar, v_bar, local_bias)  # no bias: local_bias stands in, unread
        row_max, row_sum, acc = kp.shared_keys_forward(
            row_max, row_sum, acc, queries, bar_set, batch, head, head_dim, shared.BAR, tile
        )

    for start in range(0, (tile.WINDOW + 2 * tile.PAD) * (tile.WINDOW + 2 * tile.PAD), tile.BLOCK):
        _, _, _, values, scores = _patch_tile(queries, start, k, v, local_bias, batch, head, row, col, geometry, tile)
        row_max, row_sum, acc = kp.softmax_step(row_max, row_sum, acc, scores, values, tile.DOT_PRECISION)

    if shared.GLOBAL.NUM > 0:
        global_set = (global_k, global_v, local_bias)  # no bias: local_bias stands in, unread
        row_max, row_sum, acc = kp.shared_keys_forward(
            row_max, row_sum, acc, queries, global_set, batch, head, head_dim, shared.GLOBAL, tile
        )

    lse_row = lse + batch_head * height * width
    kp.finish_forward(out, batch, head, lse_row, tokens, query_valid, head_dim, row_max, row_sum, acc, tile.BLOCK_D)


@triton.jit
def _long_short_backward_queries(
    inputs,
    out,
    grad_out,
    lse,
    delta,
    grad_q,
    grad_local_bias,
    shared_grads,
    geometry,
    bias_copies,
    tile: tl.constexpr,
    shared: tl.constexpr,
    LOCAL_BIAS_GRAD: tl.constexpr,
):
    """Gradients seen from one segment's queries; grid ``(rows * cols, batch * heads)``.

    Writes ``delta = rowsum(dO * O)`` of the segment's queries (read by
    :func:`_long_short_backward_keys`), their gradient, this segment's partial
    sums of the gradients of the projected and global keys and values
    (``(batch * heads * rows * cols, r or G, head_dim)``), and adds its patch
    logit gradients to ``grad_local_bias`` (``(bias_copies, heads, w*w, (w + 2p)^2)``, contiguous).
    """
    q, k, v, k_bar, v_bar, global_k, global_v, local_bias = inputs
    grad_k_bar, grad_v_bar, grad_global_k, grad_global_v = shared_grads
    heads, height, width, cols, head_dim = geometry
    segment, batch_head, batch, head, row, col = kp.program_chunk(heads, cols)
    tokens, query_valid = kp.chunk_tokens(row, col, height, width, tile.WINDOW, tile.BLOCK)
    lse_row, delta_row = lse + batch_head * height * width, delta + batch_head * height * width
    query_rows = kp.backward_rows(
        q, grad_out, out, batch, head, lse_row, delta_row, tokens, query_valid, head_dim, tile.BLOCK_D
    )
    queries = query_rows[0]
    grad_queries = kp.accumulator(lse, tile.BLOCK, tile.BLOCK_D)
    part = batch_head * tl.num_programs(0) + segment

    if shared.BAR.NUM > 0:
        bar_set = (k_bar, v_bar, local_bias)
        grad_parts = (grad_k_bar, grad_v_bar, lse)  # no bias gradient: lse stands in, unwritten
        grad_queries += kp.shared_keys_backward(
            query_rows, bar_set, grad_parts, part, batch, head, head_dim, shared.BAR, tile
        )
    if shared.GLOBAL.NUM > 0:
        global_set = (global_k, global_v, local_bias)
        grad_parts = (grad_global_k, grad_global_v, lse)  # no bias gradient: lse stands in, unwritten
        grad_queries += kp.shared_keys_backward(
            query_rows, global_set, grad_parts, part, batch, head, head_dim, shared.GLOBAL, tile
        )

    for start in range(0, (tile.WINDOW + 2 * tile.PAD) * (tile.WINDOW + 2 * tile.PAD), tile.BLOCK):
        patch_slots, key_valid, keys, values, scores = _patch_tile(
            queries, start, k, v, local_bias, batch, head, row, col, geometry, tile
        )
        _, grad_scores = kp.logit_grads(scores, query_rows, values, tile.DOT_PRECISION)
        grad_queries += tl.dot(grad_scores.to(keys.dtype), keys, input_precision=tile.DOT_PRECISION)
        if LOCAL_BIAS_GRAD:
            kp.add_bias_grad(
                grad_local_bias,
                bias_copies,
                heads,
                head,
                tl.arange(0, tile.BLOCK),
                patch_slots,
                grad_scores,
                query_valid[:, None] & key_valid[None, :],
                tile.WINDOW * tile.WINDOW,
                (tile.WINDOW + 2 * tile.PAD) * (tile.WINDOW + 2 * tile.PAD),
            )

    kp.store_rows(grad_q, batch, head, tokens, query_valid, head_dim, grad_queries, tile.BLOCK_D)


@triton.jit
def _long_short_backward_keys(q, k, v, local_bias, grad_out, lse, delta, grad_k, grad_v, geometry, tile: tl.constexpr):
    """Gradients of one ``w x w`` chunk of local keys and values; grid ``(rows * cols, batch * heads)``.

    Patches reach ``p <= w`` pixels beyond their segment, so only the 3 x 3
    segments around the key chunk see its keys; a key at slot ``(sy, sx)`` of the
    chunk is patch slot ``(sy - dy * w + p, sx - dx * w + p)`` of the segment
    ``(dy, dx)`` chunks away, visible where that lies in the patch.
    """
    heads, height, width, cols, head_dim = geometry
    chunk, batch_head, batch, head, key_row, key_col = kp.program_chunk(heads, cols)
    key_tokens, key_valid = kp.chunk_tokens(key_row, key_col, height, width, tile.WINDOW, tile.BLOCK)
    keys, values = kp.key_value_rows(k, v, batch, head, key_tokens, key_valid, head_dim, tile.BLOCK_D)
    grad_keys, grad_values = (
        kp.accumulator(lse, tile.BLOCK, tile.BLOCK_D),
        kp.accumulator(lse, tile.BLOCK, tile.BLOCK_D),
    )

    span = tile.WINDOW + 2 * tile.PAD
    slots = tl.arange(0, tile.BLOCK)
    lse_row, delta_row = lse + batch_head * height * width, delta + batch_head * height * width
    for step in range(9):
        row_offset, col_offset = step // 3 - 1, step % 3 - 1
        row, col = key_row + row_offset, key_col + col_offset
        tokens, query_valid = kp.chunk_tokens(row, col, height, width, tile.WINDOW, tile.BLOCK)
        # chunk_tokens already hides segments below or right of the grid (their pixels lie outside the map).
        query_valid = query_valid & (row >= 0) & (col >= 0)
        query_rows, scores = kp.query_tile(
            keys,
            q,
            grad_out,
            batch,
            head,
            lse_row,
            delta_row,
            tokens,
            query_valid,
            head_dim,
            tile.BLOCK_D,
            tile.DOT_PRECISION,
        )
        patch_y = slots // tile.WINDOW - row_offset * tile.WINDOW + tile.PAD
        patch_x = slots % tile.WINDOW - col_offset * tile.WINDOW + tile.PAD
        visible = key_valid & (patch_y >= 0) & (patch_y < span) & (patch_x >= 0) & (patch_x < span)
        scores = _window_logits(
            scores, slots[None, :], (patch_y * span + patch_x)[:, None], visible[:, None], local_bias, head, tile
        )
        grad_keys, grad_values = kp.key_grads_step(
            grad_keys, grad_values, scores, values, query_rows, tile.DOT_PRECISION
        )

    kp.store_key_grads(
        grad_k, grad_v, batch, head, key_tokens, key_valid, head_dim, grad_keys, grad_values, tile.BLOCK_D
    )


@triton.jit
def _long_short_bias_grad(inputs, grad_out, lse, delta, grad_parts, geometry, chunks, pairs, tile: tl.constexpr):
    """The window-RPB gradient without atomics: one patch tile of one head, summed over every
    ``parts``-th of the ``pairs`` (batch, segment) pairs
    (:func:`~visattn_mm.ops.triton.kernel_parts.store_bias_grad_part`); grid ``(patch tiles, heads, parts)``,
    after the query-side kernel (which writes ``delta``)."""
    # No `_` before the loop: Triton would take it for a variable the loop carries.
    q, k, v, local_bias = inputs[0], inputs[1], inputs[2], inputs[7]
    heads, height, width, cols, head_dim = geometry
    start, head = tl.program_id(0) * tile.BLOCK, tl.program_id(1)
    grad_sum = tl.zeros([tile.BLOCK, tile.BLOCK], lse.dtype.element_ty)
    for index in range(tl.program_id(2), pairs, tl.num_programs(2)):
        batch, row, col, query_rows = kp.bias_grad_chunk(index, chunks, q, grad_out, lse, delta, geometry, head, tile)
        _, key_valid, _, values, scores = _patch_tile(
            query_rows[0], start, k, v, local_bias, batch, head, row, col, geometry, tile
        )
        _, grad_scores = kp.logit_grads(scores, query_rows, values, tile.DOT_PRECISION)
        grad_sum += tl.where(query_rows[4][:, None] & key_valid[None, :], grad_scores, 0.0)
    slots = tl.arange(0, tile.BLOCK)
    patch_slots = start + slots
    chunk, patch = tile.WINDOW * tile.WINDOW, (tile.WINDOW + 2 * tile.PAD) * (tile.WINDOW + 2 * tile.PAD)
    in_patch = (slots[:, None] < chunk) & (patch_slots[None, :] < patch)
    kp.store_bias_grad_part(grad_parts, heads, head, slots, patch_slots, grad_sum, in_patch, chunk, patch)


def _launch_setup(q, k_bar, global_k, local_bias, height, width, window):
    """The kernels' :class:`~visattn_mm.ops.triton.host.LaunchPlan`."""
    batch, heads, _, head_dim = q.shape
    rows, cols = chunk_grid(height, width, window)
    num_bar = 0 if k_bar is None else k_bar.shape[2]
    num_global = 0 if global_k is None else global_k.shape[2]
    tile = _Tile(
        WINDOW=window,
        PAD=segment_pad(window),
        HAS_LOCAL_BIAS=local_bias is not None,
        BLOCK=host.tile(window * window),
        BLOCK_D=host.tile(head_dim),
        DOT_PRECISION=host.dot_precision(q.dtype),
    )
    shared = _Shared(BAR=host.shared_key_constants(num_bar), GLOBAL=host.shared_key_constants(num_global))
    return host.LaunchPlan(
        (rows * cols, batch * heads),
        (heads, height, width, cols, head_dim),
        host.constant_bundle(tile),
        host.constant_bundle(shared),
        host.launch_settings(q.dtype),
        key_tiles=triton.cdiv((window + 2 * tile.PAD) ** 2, tile.BLOCK),
    )


def _input_args(q, k, v, k_bar, v_bar, global_k, global_v, local_bias):
    """The op's tensor inputs as the forward and the query-side backward kernel take them (an :class:`_Inputs`)."""
    return _Inputs(
        *map(host.head_rows, (q, k, v)),
        *(host.head_rows(t, q) for t in (k_bar, v_bar, global_k, global_v)),
        host.bias_table(local_bias, q),
    )


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_bar: Optional[torch.Tensor],
    v_bar: Optional[torch.Tensor],
    global_k: Optional[torch.Tensor],
    global_v: Optional[torch.Tensor],
    local_bias: Optional[torch.Tensor],
    height: int,
    width: int,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and the log-sum-exp of each query's logits, ``(B * heads, H * W)``."""
    plan = _launch_setup(q, k_bar, global_k, local_bias, height, width, window)
    return host.window_softmax_forward(
        _KERNELS, plan, q, _input_args(q, k, v, k_bar, v_bar, global_k, global_v, local_bias)
    )


def _backward(
    grad_out, q, k, v, k_bar, v_bar, global_k, global_v, local_bias, out, lse, height, width, window, needs_grad
):
    """The gradients of ``q, k, v, k_bar, v_bar, global_k, global_v, local_bias``."""
    inputs = _Inputs(q, k, v, k_bar, v_bar, global_k, global_v, local_bias)
    plan = _launch_setup(q, k_bar, global_k, local_bias, height, width, window)
    grad_k_bar, grad_v_bar, _ = host.shared_key_parts(lse, plan.programs, k_bar)
    grad_global_k, grad_global_v, _ = host.shared_key_parts(lse, plan.programs, global_k)
    grad_q, grad_k, grad_v, grad_local_bias = host.window_softmax_backward(
        _KERNELS,
        plan,
        inputs,
        _input_args(*inputs),
        grad_out,
        out,
        lse,
        needs_grad,
        shared_grads=(grad_k_bar, grad_v_bar, grad_global_k, grad_global_v),
    )
    return host.gradient_list(
        [
            grad_q,
            grad_k,
            grad_v,
            host.summed_parts(grad_k_bar, k_bar),
            host.summed_parts(grad_v_bar, v_bar),
            host.summed_parts(grad_global_k, global_k),
            host.summed_parts(grad_global_v, global_v),
            grad_local_bias,
        ],
        inputs,
        needs_grad,
    )


_KERNELS = host.WindowSoftmaxKernels(
    _long_short_forward, _long_short_backward_queries, _long_short_backward_keys, _long_short_bias_grad
)
_long_short_op = host.define_op('triton_long_short_attention', _forward, _backward, _Inputs)


def triton_long_short_attention(
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
):
    """:func:`~visattn_mm.ops.long_short.long_short_attention` through the Triton kernels.

    Arguments as there. Inputs may be strided views; the output and the
    gradients of ``q, k, v`` are ``(B, heads, H*W, d)`` views of
    ``(B, H*W, heads, d)`` storage, so merging the heads afterwards is free.
    The other inputs are cast to ``q``'s dtype; the window RPB keeps its own.

    Raises:
        ValueError: For ``dropout_p > 0`` or ``window`` over 11 (not supported
            here; use impl 'fast' or 'math'), a token count other than ``height *
            width``, a window RPB of another shape than ``(heads, w*w, (w + 2p)**2)``,
            or projected (global) keys without their values, the reverse, or of
            another shape than ``(B, heads, r or G, d)``.
        RuntimeError: For tensors that are not on a CUDA device, unless Triton's
            interpreter is on (``TRITON_INTERPRET=1`` before the kernels are imported).
    """
    host.check_supported('long_short', q, height * width, window, dropout_p)
    span = window + 2 * segment_pad(window)
    host.check_bias_shape(
        local_bias, (q.shape[1], window * window, span * span), 'local_bias', '(heads, w*w, (w + 2p)**2)'
    )
    k, v = k.to(q.dtype), v.to(q.dtype)
    k_bar, v_bar = host.shared_keys(k_bar, v_bar, q, ('k_bar', 'v_bar'))
    global_k, global_v = host.shared_keys(global_k, global_v, q, ('global_k', 'global_v'))
    host.check_device(q)
    return _long_short_op(q, k, v, k_bar, v_bar, global_k, global_v, local_bias, height, width, window)[0]
