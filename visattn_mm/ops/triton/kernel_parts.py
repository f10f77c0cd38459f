"""The ``@triton.jit`` building blocks the softmax attention kernels share.

:mod:`visattn_mm.ops.sliding_chunk.triton` and :mod:`visattn_mm.ops.long_short.triton`
share a layout: one program handles one ``w x w`` chunk (ViL) or segment
(Transformer-LS) of one (batch, head) pair, slot ``s`` of its query tile being
the token ``(s // w, s % w)`` of the chunk, and every query also sees a few keys
shared by all of them (global tokens, projected keys). This module holds the
device functions for that layout -- tiles of rows, the online-softmax step, the
FlashAttention-2 backward of one tile of logits, the shared keys -- which
:mod:`visattn_mm.ops.pale.triton` and :mod:`visattn_mm.ops.vicinity.triton` use in
part. Their host side is :mod:`visattn_mm.ops.triton.host`.

Accumulation is in fp32 (fp64 for fp64 inputs); matmul inputs are the tensors'
dtype, the probabilities are rounded to it before ``@ v`` as in FlashAttention.
fp32 products use TF32 only where ``torch.get_float32_matmul_precision()`` is not
'highest' (as PyTorch's matmuls).
"""

import triton
import triton.language as tl


@triton.jit
def chunk_tokens(chunk_row, chunk_col, height, width, WINDOW: tl.constexpr, BLOCK: tl.constexpr):
    """Row-major token index of each chunk slot, and whether the slot is a token of the map.

    Chunks beyond the bottom or right of the map come out all invalid; those at
    negative coordinates do not (callers that reach them mask them).
    """
    slots = tl.arange(0, BLOCK)
    y = chunk_row * WINDOW + slots // WINDOW
    x = chunk_col * WINDOW + slots % WINDOW
    valid = (slots < WINDOW * WINDOW) & (y < height) & (x < width)
    return y * width + x, valid


@triton.jit
def load_rows(t, batch, head, rows, valid, head_dim, BLOCK_D: tl.constexpr):
    """``(len(rows), BLOCK_D)`` tile of the ``(batch, head)`` rows of a ``(B, heads, N, d)`` tensor ``t`` (a
    :class:`~visattn_mm.ops.triton.host.HeadRows`), zero where not valid."""
    dims = tl.arange(0, BLOCK_D)
    base = t.ptr + batch * t.batch + head * t.head
    pointers = base + rows[:, None] * t.row + dims[None, :] * t.dim
    return tl.load(pointers, mask=valid[:, None] & (dims < head_dim)[None, :], other=0.0)


@triton.jit
def store_rows(t, batch, head, rows, valid, head_dim, tile, BLOCK_D: tl.constexpr):
    """Store ``tile`` where :func:`load_rows` would load it, in the tensor's dtype."""
    dims = tl.arange(0, BLOCK_D)
    base = t.ptr + batch * t.batch + head * t.head
    pointers = base + rows[:, None] * t.row + dims[None, :] * t.dim
    tl.store(pointers, tile.to(t.ptr.dtype.element_ty), mask=valid[:, None] & (dims < head_dim)[None, :])


@triton.jit
def program_chunk(heads, cols):
    """This program's chunk (or segment) and (batch, head) pair on a ``(rows * cols, batch * heads)`` grid:
    ``(chunk, batch_head, batch, head, row, col)``."""
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1)
    return chunk, batch_head, batch_head // heads, batch_head % heads, chunk // cols, chunk % cols


@triton.jit
def key_value_rows(k, v, batch, head, tokens, valid, head_dim, BLOCK_D: tl.constexpr):
    """Tiles of keys and values at ``tokens`` (see :func:`load_rows`)."""
    return (
        load_rows(k, batch, head, tokens, valid, head_dim, BLOCK_D),
        load_rows(v, batch, head, tokens, valid, head_dim, BLOCK_D),
    )


@triton.jit
def key_tile(queries, k, v, batch, head, tokens, valid, head_dim, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Keys and values at ``tokens`` and their ``(queries, keys)`` tile of dot products."""
    keys, values = key_value_rows(k, v, batch, head, tokens, valid, head_dim, BLOCK_D)
    return keys, values, tl.dot(queries, tl.trans(keys), input_precision=DOT_PRECISION)


@triton.jit
def accumulator(lse, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """A zero ``(BLOCK, BLOCK_D)`` tile in the accumulation dtype (that of ``lse``)."""
    return tl.zeros([BLOCK, BLOCK_D], lse.dtype.element_ty)


@triton.jit
def softmax_start(lse, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online-softmax state before any key: row maxima, row sums and the output accumulator."""
    return (
        tl.full([BLOCK], float('-inf'), lse.dtype.element_ty),
        tl.zeros([BLOCK], lse.dtype.element_ty),
        accumulator(lse, BLOCK, BLOCK_D),
    )


@triton.jit
def softmax_step(row_max, row_sum, acc, scores, values, DOT_PRECISION: tl.constexpr):
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
def finish_forward(out, batch, head, lse, tokens, query_valid, head_dim, row_max, row_sum, acc, BLOCK_D: tl.constexpr):
    """Stores the normalised output rows of a query chunk and their log-sum-exp (``lse`` at the
    chunk's (batch, head) row); every real query sees its own token, the guard only keeps the
    padding slots finite."""
    row_sum = tl.where(row_sum == 0, 1.0, row_sum)
    store_rows(out, batch, head, tokens, query_valid, head_dim, acc / row_sum[:, None], BLOCK_D)
    tl.store(lse + tokens, row_max + tl.log(row_sum), mask=query_valid)


@triton.jit
def backward_rows(q, grad_out, out, batch, head, lse, delta, tokens, query_valid, head_dim, BLOCK_D: tl.constexpr):
    """The query side of a query chunk's backward, and stores its ``delta = rowsum(dO * O)`` (``lse`` and
    ``delta`` at the chunk's (batch, head) row) for the key-centric kernel.

    Returns:
        The chunk's *query rows*, one tuple ``(queries, grad_rows, row_lse, row_delta, query_valid)``:
        queries, output gradients, log-sum-exps, deltas and which slots are queries, as
        :func:`logit_grads`, :func:`key_grads_step` and :func:`shared_keys_backward` take them.
    """
    queries = load_rows(q, batch, head, tokens, query_valid, head_dim, BLOCK_D)
    grad_rows = load_rows(grad_out, batch, head, tokens, query_valid, head_dim, BLOCK_D)
    outputs = load_rows(out, batch, head, tokens, query_valid, head_dim, BLOCK_D)
    acc_dtype = lse.dtype.element_ty
    row_delta = tl.sum(grad_rows.to(acc_dtype) * outputs.to(acc_dtype), 1)
    tl.store(delta + tokens, row_delta, mask=query_valid)
    row_lse = tl.load(lse + tokens, mask=query_valid, other=0.0)
    return queries, grad_rows, row_lse, row_delta, query_valid


@triton.jit
def logit_grads(scores, query_rows, values, DOT_PRECISION: tl.constexpr):
    """FlashAttention-2 backward of a ``(queries, keys)`` tile of logits: the probabilities, recomputed
    from the log-sum-exps (0 for padding queries), and the logit gradients ``P * (dO V^T - delta)``."""
    _, grad_rows, row_lse, row_delta, query_valid = query_rows
    probs = tl.where(query_valid[:, None], tl.exp(scores - row_lse[:, None]), 0.0)
    grad_probs = tl.dot(grad_rows, tl.trans(values), input_precision=DOT_PRECISION)
    return probs, probs * (grad_probs - row_delta[:, None])


@triton.jit
def query_tile(
    keys,
    q,
    grad_out,
    batch,
    head,
    lse,
    delta,
    tokens,
    query_valid,
    head_dim,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """For a key-centric kernel: a query chunk's query rows (see :func:`backward_rows`; ``lse`` and
    ``delta`` at the chunk's (batch, head) row, read, not written) and the ``(keys, queries)`` tile of
    dot products (transposed, see :func:`key_grads_step`)."""
    queries = load_rows(q, batch, head, tokens, query_valid, head_dim, BLOCK_D)
    grad_rows = load_rows(grad_out, batch, head, tokens, query_valid, head_dim, BLOCK_D)
    row_lse = tl.load(lse + tokens, mask=query_valid, other=0.0)
    row_delta = tl.load(delta + tokens, mask=query_valid, other=0.0)
    query_rows = (queries, grad_rows, row_lse, row_delta, query_valid)
    return query_rows, tl.dot(keys, tl.trans(queries), input_precision=DOT_PRECISION)


@triton.jit
def read_query_rows(q, grad_out, batch, head, lse, delta, tokens, query_valid, head_dim, BLOCK_D: tl.constexpr):
    """A query chunk's query rows (see :func:`backward_rows`) after the query-side kernel has written
    their ``delta``: ``lse`` and ``delta`` at the chunk's (batch, head) row, read only.

    :func:`query_tile` loads the same inline: calling this from there changes Pale's compiled code (sm_90,
    Triton 3.7), and with it the digest its GPU rows were measured with (:mod:`visattn_mm.ops.kernel_digests`)."""
    queries = load_rows(q, batch, head, tokens, query_valid, head_dim, BLOCK_D)
    grad_rows = load_rows(grad_out, batch, head, tokens, query_valid, head_dim, BLOCK_D)
    row_lse = tl.load(lse + tokens, mask=query_valid, other=0.0)
    row_delta = tl.load(delta + tokens, mask=query_valid, other=0.0)
    return queries, grad_rows, row_lse, row_delta, query_valid


@triton.jit
def key_grads_step(grad_keys, grad_values, scores, values, query_rows, DOT_PRECISION: tl.constexpr):
    """Adds one query chunk's share (its query rows, see :func:`query_tile`) to the gradients of a key
    chunk's keys and values.

    ``scores`` is the ``(keys, queries)`` tile of masked logits: transposed, so
    that the products here need no transposed register tile.
    """
    queries, grad_rows, row_lse, row_delta, query_valid = query_rows
    probs = tl.where(query_valid[None, :], tl.exp(scores - row_lse[None, :]), 0.0)
    grad_values += tl.dot(probs.to(grad_rows.dtype), grad_rows, input_precision=DOT_PRECISION)
    grad_probs = tl.dot(values, tl.trans(grad_rows), input_precision=DOT_PRECISION)
    grad_scores = probs * (grad_probs - row_delta[None, :])
    grad_keys += tl.dot(grad_scores.to(queries.dtype), queries, input_precision=DOT_PRECISION)
    return grad_keys, grad_values


@triton.jit
def store_key_grads(
    grad_k, grad_v, batch, head, key_tokens, key_valid, head_dim, grad_keys, grad_values, BLOCK_D: tl.constexpr
):
    """Stores a key chunk's key and value gradients (see :func:`store_rows`)."""
    store_rows(grad_k, batch, head, key_tokens, key_valid, head_dim, grad_keys, BLOCK_D)
    store_rows(grad_v, batch, head, key_tokens, key_valid, head_dim, grad_values, BLOCK_D)


@triton.jit
def add_bias_grad(
    grad_bias,
    copies,
    heads,
    head,
    query_slots,
    columns,
    grad_scores,
    mask,
    QUERIES: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """Adds a ``(queries, keys)`` tile of logit gradients to a contiguous ``(copies, heads, QUERIES, COLUMNS)``
    bias gradient, summed over the copies afterwards (see
    :func:`~visattn_mm.ops.triton.host.bias_grad_copies`): atomics, since every chunk of every batch
    element adds to the same table, into copy ``program % copies``."""
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    table = (program % copies) * heads + head
    pointers = grad_bias + (table * QUERIES + query_slots[:, None]) * COLUMNS + columns[None, :]
    tl.atomic_add(pointers, grad_scores, mask=mask, sem='relaxed')


@triton.jit
def bias_grad_chunk(index, chunks, q, grad_out, lse, delta, sizes, head, tile: tl.constexpr):
    """Pair ``index`` of the ``(batch, query chunk)`` pairs a bias-gradient program loops over
    (:func:`store_bias_grad_part`): its batch element, chunk row and column, and query rows
    (:func:`read_query_rows`). ``chunks``: query chunks per image; ``sizes``: ``(heads, height, width,
    cols, head_dim)``."""
    heads, height, width, cols, head_dim = sizes
    batch, chunk = index // chunks, index % chunks
    row, col = chunk // cols, chunk % cols
    tokens, query_valid = chunk_tokens(row, col, height, width, tile.WINDOW, tile.BLOCK)
    offset = (batch * heads + head) * height * width
    query_rows = read_query_rows(
        q, grad_out, batch, head, lse + offset, delta + offset, tokens, query_valid, head_dim, tile.BLOCK_D
    )
    return batch, row, col, query_rows


@triton.jit
def store_bias_grad_part(
    grad_parts, heads, head, query_slots, columns, grad_scores, mask, QUERIES: tl.constexpr, COLUMNS: tl.constexpr
):
    """Stores a program's sum of ``(queries, keys)`` logit-gradient tiles into its part of a contiguous
    ``(parts, heads, QUERIES, COLUMNS)`` bias gradient, part ``tl.program_id(2)``; the host sums the parts.

    The bias gradient without atomics (:func:`~visattn_mm.ops.triton.host.bias_grad_copies` 0, and always under
    ``torch.use_deterministic_algorithms``): a program of grid ``(key tiles, heads, parts)`` owns one key
    tile of one head and loops, in a fixed order, over every ``parts``-th (batch, query chunk) pair, so the
    sum has the same bits on every run."""
    table = tl.program_id(2) * heads + head
    pointers = grad_parts + (table * QUERIES + query_slots[:, None]) * COLUMNS + columns[None, :]
    tl.store(pointers, grad_scores, mask=mask)


@triton.jit
def _shared_key_tile(queries, key_set, batch, head, head_dim, constants: tl.constexpr, tile: tl.constexpr):
    """Slots, validity, keys, values and logits (plus the per-key bias; ``-inf`` in the padding
    slots) of a set of shared keys (global or projected) for a query chunk."""
    keys, values, bias = key_set
    slots = tl.arange(0, constants.BLOCK)
    valid = slots < constants.NUM
    key_rows, value_rows, scores = key_tile(
        queries, keys, values, batch, head, slots, valid, head_dim, tile.BLOCK_D, tile.DOT_PRECISION
    )
    if constants.HAS_BIAS:
        pointers = bias.ptr + head * bias.head + slots * bias.key
        scores += tl.load(pointers, mask=valid, other=0.0).to(scores.dtype)[None, :]
    return slots, valid, key_rows, value_rows, tl.where(valid[None, :], scores, float('-inf'))


@triton.jit
def shared_keys_forward(
    row_max, row_sum, acc, queries, key_set, batch, head, head_dim, constants: tl.constexpr, tile: tl.constexpr
):
    """Online-softmax step over a set of keys every query sees.

    ``key_set`` is ``(keys, values, bias)``: :class:`~visattn_mm.ops.triton.host.HeadRows` and a
    :class:`~visattn_mm.ops.triton.host.BiasTable` of one logit per key, read only where ``constants``
    (:class:`~visattn_mm.ops.triton.host.SharedKeys`) says ``HAS_BIAS``; ``tile`` is the kernel's
    bundle (its ``BLOCK_D`` and ``DOT_PRECISION``).
    """
    _, _, _, value_rows, scores = _shared_key_tile(queries, key_set, batch, head, head_dim, constants, tile)
    return softmax_step(row_max, row_sum, acc, scores, value_rows, tile.DOT_PRECISION)


@triton.jit
def shared_keys_backward(
    query_rows, key_set, grad_parts, part, batch, head, head_dim, constants: tl.constexpr, tile: tl.constexpr
):
    """Backward of :func:`shared_keys_forward` for one query chunk (its query rows, see
    :func:`backward_rows`).

    Stores the chunk's partial gradients of the keys and values (rows ``part`` of contiguous
    ``(parts, NUM, head_dim)`` buffers, the first two of ``grad_parts``, summed afterwards, see
    :func:`~visattn_mm.ops.triton.host.shared_key_parts`) and, where ``constants.HAS_BIAS``, of the
    bias (``(parts, NUM)``, the third).

    Returns:
        The chunk's share of the gradient of its queries.
    """
    grad_keys_part, grad_values_part, grad_bias_part = grad_parts
    queries, grad_rows, _, _, _ = query_rows
    slots, valid, key_rows, value_rows, scores = _shared_key_tile(
        queries, key_set, batch, head, head_dim, constants, tile
    )
    probs, grad_scores = logit_grads(scores, query_rows, value_rows, tile.DOT_PRECISION)
    dims = tl.arange(0, tile.BLOCK_D)
    part_offsets = (part * constants.NUM + slots)[:, None] * head_dim + dims[None, :]
    part_mask = valid[:, None] & (dims < head_dim)[None, :]
    tl.store(
        grad_keys_part + part_offsets,
        tl.dot(tl.trans(grad_scores.to(queries.dtype)), queries, input_precision=tile.DOT_PRECISION),
        mask=part_mask,
    )
    tl.store(
        grad_values_part + part_offsets,
        tl.dot(tl.trans(probs.to(grad_rows.dtype)), grad_rows, input_precision=tile.DOT_PRECISION),
        mask=part_mask,
    )
    if constants.HAS_BIAS:
        tl.store(grad_bias_part + part * constants.NUM + slots, tl.sum(grad_scores, 0), mask=valid)
    return tl.dot(grad_scores.to(key_rows.dtype), key_rows, input_precision=tile.DOT_PRECISION)
