"""Pieces shared by the fused Triton attention kernels (``impl='triton'``).

:mod:`visattn_mm.ops.triton_sliding_chunk` and :mod:`visattn_mm.ops.triton_long_short`
share a layout: one program handles one ``w x w`` chunk (ViL) or segment
(Transformer-LS) of one (batch, head) pair, slot ``s`` of its query tile being
the token ``(s // w, s % w)`` of the chunk, and every query also sees a few keys
shared by all of them (global tokens, projected keys). This module holds the
device functions for that layout -- tiles of rows, the online-softmax step, the
FlashAttention-2 backward of one tile of logits, the shared keys -- and the host
side common to both ops: launching and counting kernels, tile sizes, dtypes and
the checks of what the kernels support.

Accumulation is in fp32 (fp64 for fp64 inputs); matmul inputs are the tensors'
dtype, the probabilities are rounded to it before ``@ v`` as in FlashAttention.
fp32 products use TF32 only where ``torch.get_float32_matmul_precision()`` is not
'highest' (as PyTorch's matmuls).

The kernels run on CUDA tensors. Triton's interpreter runs them on CPU tensors
(float64 included) when ``TRITON_INTERPRET=1`` is in the environment before the
kernels are imported (tests).
"""
import collections
import contextlib

import torch

from .impl import dispatch_device_type

try:
    import triton
    import triton.language as tl
except ImportError as error:
    raise ImportError(f"attention impl 'triton' needs the triton package, which does not import here ({error}). "
                      "Install the triton version that matches your PyTorch (`pip install triton`; Linux CUDA "
                      "builds of PyTorch bring it), or choose impl 'fast' or 'math'.") from error

# Launches per kernel name since import (tests use it to prove the Triton path ran).
KERNEL_LAUNCHES = collections.Counter()

# Smallest tile side: tl.dot needs at least 16 rows, columns and depth on GPUs.
MIN_TILE = 16


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
def load_rows(base, rows, valid, stride_row, stride_dim, head_dim, BLOCK_D: tl.constexpr):
    """``(len(rows), BLOCK_D)`` tile of a ``(..., rows, head_dim)`` tensor, zero where not valid."""
    dims = tl.arange(0, BLOCK_D)
    pointers = base + rows[:, None] * stride_row + dims[None, :] * stride_dim
    return tl.load(pointers, mask=valid[:, None] & (dims < head_dim)[None, :], other=0.0)


@triton.jit
def store_rows(base, rows, valid, stride_row, stride_dim, head_dim, tile, BLOCK_D: tl.constexpr):
    """Store ``tile`` where :func:`load_rows` would load it, in the tensor's dtype."""
    dims = tl.arange(0, BLOCK_D)
    pointers = base + rows[:, None] * stride_row + dims[None, :] * stride_dim
    tl.store(pointers, tile.to(base.dtype.element_ty), mask=valid[:, None] & (dims < head_dim)[None, :])


@triton.jit
def program_chunk(heads, cols):
    """This program's chunk (or segment) and (batch, head) pair on a ``(rows * cols, batch * heads)`` grid:
    ``(chunk, batch_head, batch, head, row, col)``."""
    chunk = tl.program_id(0)
    batch_head = tl.program_id(1)
    return chunk, batch_head, batch_head // heads, batch_head % heads, chunk // cols, chunk % cols


@triton.jit
def key_value_rows(k_base, v_base, tokens, valid, k_sn, k_sd, v_sn, v_sd, head_dim, BLOCK_D: tl.constexpr):
    """Tiles of keys and values at ``tokens`` (see :func:`load_rows`)."""
    return (load_rows(k_base, tokens, valid, k_sn, k_sd, head_dim, BLOCK_D),
            load_rows(v_base, tokens, valid, v_sn, v_sd, head_dim, BLOCK_D))


@triton.jit
def key_tile(queries, k_base, v_base, tokens, valid, k_sn, k_sd, v_sn, v_sd, head_dim, BLOCK_D: tl.constexpr,
             DOT_PRECISION: tl.constexpr):
    """Keys and values at ``tokens`` and their ``(queries, keys)`` tile of dot products."""
    keys, values = key_value_rows(k_base, v_base, tokens, valid, k_sn, k_sd, v_sn, v_sd, head_dim, BLOCK_D)
    return keys, values, tl.dot(queries, tl.trans(keys), input_precision=DOT_PRECISION)


@triton.jit
def accumulator(lse, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """A zero ``(BLOCK, BLOCK_D)`` tile in the accumulation dtype (that of ``lse``)."""
    return tl.zeros([BLOCK, BLOCK_D], lse.dtype.element_ty)


@triton.jit
def softmax_start(lse, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online-softmax state before any key: row maxima, row sums and the output accumulator."""
    return (tl.full([BLOCK], float('-inf'), lse.dtype.element_ty), tl.zeros([BLOCK], lse.dtype.element_ty),
            accumulator(lse, BLOCK, BLOCK_D))


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
def finish_forward(out_base, lse, tokens, query_valid, o_sn, o_sd, head_dim, row_max, row_sum, acc,
                   BLOCK_D: tl.constexpr):
    """Stores the normalised output rows of a query chunk and their log-sum-exp (``lse`` at the
    chunk's (batch, head) row); every real query sees its own token, the guard only keeps the
    padding slots finite."""
    row_sum = tl.where(row_sum == 0, 1.0, row_sum)
    store_rows(out_base, tokens, query_valid, o_sn, o_sd, head_dim, acc / row_sum[:, None], BLOCK_D)
    tl.store(lse + tokens, row_max + tl.log(row_sum), mask=query_valid)


@triton.jit
def backward_rows(q_base, do_base, o_base, lse, delta, tokens, query_valid, q_sn, q_sd, do_sn, do_sd, o_sn, o_sd,
                  head_dim, BLOCK_D: tl.constexpr):
    """A query chunk's queries, output gradients, log-sum-exps and ``delta = rowsum(dO * O)``; stores
    ``delta`` (``lse`` and ``delta`` at the chunk's (batch, head) row) for the key-centric kernel."""
    queries = load_rows(q_base, tokens, query_valid, q_sn, q_sd, head_dim, BLOCK_D)
    grad_rows = load_rows(do_base, tokens, query_valid, do_sn, do_sd, head_dim, BLOCK_D)
    outputs = load_rows(o_base, tokens, query_valid, o_sn, o_sd, head_dim, BLOCK_D)
    acc_dtype = lse.dtype.element_ty
    row_delta = tl.sum(grad_rows.to(acc_dtype) * outputs.to(acc_dtype), 1)
    tl.store(delta + tokens, row_delta, mask=query_valid)
    row_lse = tl.load(lse + tokens, mask=query_valid, other=0.0)
    return queries, grad_rows, row_lse, row_delta


@triton.jit
def logit_grads(scores, row_lse, row_delta, query_valid, grad_rows, values, DOT_PRECISION: tl.constexpr):
    """FlashAttention-2 backward of a ``(queries, keys)`` tile of logits: the probabilities, recomputed
    from the log-sum-exps (0 for padding queries), and the logit gradients ``P * (dO V^T - delta)``."""
    probs = tl.where(query_valid[:, None], tl.exp(scores - row_lse[:, None]), 0.0)
    grad_probs = tl.dot(grad_rows, tl.trans(values), input_precision=DOT_PRECISION)
    return probs, probs * (grad_probs - row_delta[:, None])


@triton.jit
def query_tile(keys, q_base, do_base, lse, delta, tokens, query_valid, q_sn, q_sd, do_sn, do_sd, head_dim,
               BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """For a key-centric kernel: a query chunk's queries, output gradients, saved log-sum-exps and
    deltas (``lse`` and ``delta`` at the chunk's (batch, head) row), and the ``(keys, queries)`` tile of
    dot products (transposed, see :func:`key_grads_step`)."""
    queries = load_rows(q_base, tokens, query_valid, q_sn, q_sd, head_dim, BLOCK_D)
    grad_rows = load_rows(do_base, tokens, query_valid, do_sn, do_sd, head_dim, BLOCK_D)
    row_lse = tl.load(lse + tokens, mask=query_valid, other=0.0)
    row_delta = tl.load(delta + tokens, mask=query_valid, other=0.0)
    return queries, grad_rows, row_lse, row_delta, tl.dot(keys, tl.trans(queries), input_precision=DOT_PRECISION)


@triton.jit
def key_grads_step(grad_keys, grad_values, scores, values, queries, grad_rows, row_lse, row_delta, query_valid,
                   DOT_PRECISION: tl.constexpr):
    """Adds one query chunk's share to the gradients of a key chunk's keys and values.

    ``scores`` is the ``(keys, queries)`` tile of masked logits: transposed, so
    that the products here need no transposed register tile.
    """
    probs = tl.where(query_valid[None, :], tl.exp(scores - row_lse[None, :]), 0.0)
    grad_values += tl.dot(probs.to(grad_rows.dtype), grad_rows, input_precision=DOT_PRECISION)
    grad_probs = tl.dot(values, tl.trans(grad_rows), input_precision=DOT_PRECISION)
    grad_scores = probs * (grad_probs - row_delta[None, :])
    grad_keys += tl.dot(grad_scores.to(queries.dtype), queries, input_precision=DOT_PRECISION)
    return grad_keys, grad_values


@triton.jit
def store_key_grads(dk_base, dv_base, key_tokens, key_valid, dk_sn, dk_sd, dv_sn, dv_sd, head_dim, grad_keys,
                    grad_values, BLOCK_D: tl.constexpr):
    """Stores a key chunk's key and value gradients (see :func:`store_rows`)."""
    store_rows(dk_base, key_tokens, key_valid, dk_sn, dk_sd, head_dim, grad_keys, BLOCK_D)
    store_rows(dv_base, key_tokens, key_valid, dv_sn, dv_sd, head_dim, grad_values, BLOCK_D)


@triton.jit
def add_bias_grad(grad_bias, copies, heads, head, query_slots, columns, grad_scores, mask, QUERIES: tl.constexpr,
                  COLUMNS: tl.constexpr):
    """Adds a ``(queries, keys)`` tile of logit gradients to a contiguous ``(copies, heads, QUERIES, COLUMNS)``
    bias gradient, summed over the copies afterwards (see :func:`bias_grad_copies`): atomics, since every
    chunk of every batch element adds to the same table, into copy ``program % copies``."""
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    table = (program % copies) * heads + head
    pointers = grad_bias + (table * QUERIES + query_slots[:, None]) * COLUMNS + columns[None, :]
    tl.atomic_add(pointers, grad_scores, mask=mask, sem='relaxed')


@triton.jit
def _shared_key_tile(queries, keys, values, k_sn, k_sd, v_sn, v_sd, bias, bias_stride, head_dim,
                     NUM_KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                     DOT_PRECISION: tl.constexpr):
    """Slots, validity, keys, values and logits (plus the per-key bias; ``-inf`` in the padding
    slots) of ``NUM_KEYS`` shared keys (global or projected) for a query chunk."""
    slots = tl.arange(0, BLOCK_KEYS)
    valid = slots < NUM_KEYS
    key_rows, value_rows, scores = key_tile(queries, keys, values, slots, valid, k_sn, k_sd, v_sn, v_sd, head_dim,
                                            BLOCK_D, DOT_PRECISION)
    if HAS_BIAS:
        scores += tl.load(bias + slots * bias_stride, mask=valid, other=0.0).to(scores.dtype)[None, :]
    return slots, valid, key_rows, value_rows, tl.where(valid[None, :], scores, float('-inf'))


@triton.jit
def shared_keys_forward(row_max, row_sum, acc, queries, keys, k_sn, k_sd, values, v_sn, v_sd, bias, bias_stride,
                        head_dim, NUM_KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax step over the ``NUM_KEYS`` keys every query sees.

    ``keys``, ``values`` and ``bias`` point at the program's (batch, head) rows;
    ``bias`` (one logit per key) is read only where ``HAS_BIAS``.
    """
    _, _, _, value_rows, scores = _shared_key_tile(queries, keys, values, k_sn, k_sd, v_sn, v_sd, bias, bias_stride,
                                                   head_dim, NUM_KEYS, HAS_BIAS, BLOCK_D, BLOCK_KEYS, DOT_PRECISION)
    return softmax_step(row_max, row_sum, acc, scores, value_rows, DOT_PRECISION)


@triton.jit
def shared_keys_backward(queries, grad_rows, query_valid, row_lse, row_delta, keys, k_sn, k_sd, values, v_sn, v_sd,
                         bias, bias_stride, grad_keys_part, grad_values_part, grad_bias_part, part, head_dim,
                         NUM_KEYS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Backward of :func:`shared_keys_forward` for one query chunk.

    Stores the chunk's partial gradients of the keys and values (rows ``part``
    of contiguous ``(parts, NUM_KEYS, head_dim)`` buffers, summed afterwards, see
    :func:`shared_key_parts`) and, where ``HAS_BIAS``, of the bias
    (``(parts, NUM_KEYS)``).

    Returns:
        The chunk's share of the gradient of its queries.
    """
    slots, valid, key_rows, value_rows, scores = _shared_key_tile(
        queries, keys, values, k_sn, k_sd, v_sn, v_sd, bias, bias_stride, head_dim, NUM_KEYS, HAS_BIAS, BLOCK_D,
        BLOCK_KEYS, DOT_PRECISION)
    probs, grad_scores = logit_grads(scores, row_lse, row_delta, query_valid, grad_rows, value_rows, DOT_PRECISION)
    dims = tl.arange(0, BLOCK_D)
    part_offsets = (part * NUM_KEYS + slots)[:, None] * head_dim + dims[None, :]
    part_mask = valid[:, None] & (dims < head_dim)[None, :]
    tl.store(grad_keys_part + part_offsets, tl.dot(tl.trans(grad_scores.to(queries.dtype)), queries,
                                                   input_precision=DOT_PRECISION), mask=part_mask)
    tl.store(grad_values_part + part_offsets, tl.dot(tl.trans(probs.to(grad_rows.dtype)), grad_rows,
                                                     input_precision=DOT_PRECISION), mask=part_mask)
    if HAS_BIAS:
        tl.store(grad_bias_part + part * NUM_KEYS + slots, tl.sum(grad_scores, 0), mask=valid)
    return tl.dot(grad_scores.to(key_rows.dtype), key_rows, input_precision=DOT_PRECISION)


# Any JITFunction subclass compiles; the interpreter's stand-in is not one.
INTERPRETED = not isinstance(load_rows, triton.runtime.JITFunction)


def launch(kernel, grid, settings, *args, **constexprs):
    """Counts and launches ``kernel`` with ``settings`` (``num_warps``, ``num_stages``: see
    :func:`launch_settings`) on the device of its first argument (a tensor); tests and
    ``tools/analysis/triton_resources.py`` replace this to compile without a GPU."""
    KERNEL_LAUNCHES[kernel.fn.__name__] += 1
    with on_device(args[0].device):
        kernel[grid](*args, **settings, **constexprs)


def on_device(device):
    """Makes a CUDA ``device`` the current one inside: Triton launches on the current device and stream,
    which need not be the tensors' (a model on ``cuda:1`` in a process whose current device is 0)."""
    return torch.cuda.device(device) if device.type == 'cuda' else contextlib.nullcontext()


def define_op(name, forward, forward_fake, backward, num_tensor_inputs):
    """Registers a kernel pair as the custom ops ``visattn_mm::<name>`` and
    ``visattn_mm::<name>_backward``, linked by an autograd formula.

    As custom ops, the kernel launches are one opaque node per direction for
    torch.compile: Dynamo and AOTAutograd take the output shapes from the fake
    functions and never trace into Triton (``tests/test_compile.py``).

    Args:
        name (str): The op's name in the ``visattn_mm`` namespace.
        forward (callable): ``(tensor inputs..., geometry...) -> (out, *saved)``,
            with type annotations (they are the op's schema). The first three
            tensor inputs are ``q, k, v``; the others may be None.
        forward_fake (callable): ``forward``'s outputs as empty tensors, from the
            same arguments.
        backward (callable): ``(grad_out, tensor inputs..., forward outputs...,
            geometry..., needs_grad) -> list[Tensor]``, annotated; ``needs_grad``
            holds ``needs_input_grad`` of the tensor inputs; the result comes from
            :func:`gradient_list`.
        num_tensor_inputs (int): How many leading arguments of ``forward`` are tensors.

    Returns:
        The forward op: call it with ``forward``'s arguments; it returns ``(out, *saved)``.
    """
    forward_op = torch.library.custom_op(f'visattn_mm::{name}', forward, mutates_args=())
    forward_op.register_fake(forward_fake)
    backward_op = torch.library.custom_op(f'visattn_mm::{name}_backward', backward, mutates_args=())

    @backward_op.register_fake
    def _(grad_out, *args):
        inputs, needs_grad = args[:num_tensor_inputs], args[-1]
        empty = [like_heads_last(t) if i < 3 else t if t is None else t.new_empty(t.shape)
                 for i, t in enumerate(inputs)]
        return gradient_list(empty, inputs, needs_grad)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:num_tensor_inputs], *output)
        ctx.geometry = inputs[num_tensor_inputs:]

    def differentiate(ctx, grad_out, *_saved_grads):
        saved = ctx.saved_tensors
        needs_grad = list(ctx.needs_input_grad[:num_tensor_inputs])
        grads = backward_op(grad_out, *saved, *ctx.geometry, needs_grad)
        inputs = saved[:num_tensor_inputs]
        wanted = [gradient_wanted(i, inputs, needs_grad) for i in range(num_tensor_inputs)]
        return (*(g if want else None for g, want in zip(grads, wanted)), *(None, ) * len(ctx.geometry))

    forward_op.register_autograd(differentiate, setup_context=setup_context)
    return forward_op


def gradient_wanted(index, inputs, needs_grad):
    """Whether the backward op returns the gradient of tensor input ``index``: always for ``q, k, v``
    (their kernels write it anyway), for the others where given and needed."""
    return index < 3 or (inputs[index] is not None and needs_grad[index])


def gradient_list(grads, inputs, needs_grad):
    """The backward op's result: per tensor input its gradient where :func:`gradient_wanted` (for
    ``q, k, v`` stored as :func:`like_heads_last`, for the others contiguous), else an empty
    placeholder (a custom op returns no None)."""
    return [grad if gradient_wanted(i, inputs, needs_grad) else inputs[0].new_empty(0)
            for i, grad in enumerate(grads)]


def check_supported(q, tokens, dropout_p):
    """Refuses attention dropout, naming the alternative, and another token count than the map's.

    Args:
        q (Tensor): ``(B, heads, N, d)`` queries.
        tokens (int): ``N`` the map has (``height * width``).
        dropout_p (float): Attention dropout asked for.

    Raises:
        ValueError: For ``dropout_p > 0`` or another token count.
    """
    if dropout_p > 0:
        raise ValueError(f"impl 'triton' does not support attention dropout (dropout_p={dropout_p}); "
                         "use impl 'fast' or 'math' with dropout, or set the attention dropout to 0")
    if q.shape[2] != tokens:
        raise ValueError(f'q has {q.shape[2]} tokens, not height * width = {tokens}')


def check_device(q):
    """Refuses tensors that are not on a CUDA device, naming the alternative, unless Triton's interpreter
    is on (then the kernels run on CPU tensors).

    Raises:
        RuntimeError: For such tensors.
    """
    if dispatch_device_type(q.device.type) != 'cuda' and not INTERPRETED:
        raise RuntimeError(f"impl 'triton' runs on CUDA tensors, got {q.device.type} ones; use impl 'fast' or "
                           "'math' there (TRITON_INTERPRET=1 set before visattn_mm's Triton kernels are "
                           'imported runs them on the CPU, slowly, for tests)')


def shared_keys(keys, values, q, names):
    """Keys and values every query sees, in ``q``'s dtype; ``(None, None)`` where there are none.

    Args:
        keys (Tensor | None): ``(B, heads, M, d)``.
        values (Tensor | None): ``(B, heads, M, d)``.
        q (Tensor): The ``(B, heads, N, d)`` queries.
        names (tuple[str, str]): The arguments' names, for the error.

    Raises:
        ValueError: For keys without values or the reverse, or of another shape than ``(B, heads, M, d)``.
    """
    if (keys is None) != (values is None):
        raise ValueError(f'{names[0]} and {names[1]} must be given together')
    if keys is None or keys.shape[2] == 0:
        return None, None
    batch, heads, _, head_dim = q.shape
    for name, tensor in zip(names, (keys, values)):
        if tensor.dim() != 4 or tuple(tensor.shape) != (batch, heads, keys.shape[2], head_dim):
            raise ValueError(f'{name} has shape {tuple(tensor.shape)}, not (B, heads, M, d) = '
                             f'({batch}, {heads}, {keys.shape[2]}, {head_dim}) like q')
    return keys.to(q.dtype), values.to(q.dtype)


def check_bias_shape(bias, shape, name, layout):
    """Refuses a bias of another shape than the kernels index (they read it unchecked).

    Args:
        bias (Tensor | None): The bias, or None.
        shape (tuple[int, ...]): The shape the kernels expect.
        name (str): The argument's name, for the error.
        layout (str): What ``shape`` stands for, for the error.

    Raises:
        ValueError: For a bias of another shape.
    """
    if bias is not None and tuple(bias.shape) != tuple(shape):
        raise ValueError(f'{name} has shape {tuple(bias.shape)}, not {layout} = {tuple(shape)}')


# Largest tile of a chunk's (segment's) slots: one tile covers a ``w x w`` chunk, and tiles of 256 slots
# (``w`` from 12) need more shared memory than an H100's 227 KB (sm_90 compiles: 330 KB for the fp32
# forward of sliding-chunk attention at ``w = 12``).
MAX_CHUNK_TILE = 128


def check_window(window):
    """Refuses chunk (segment) sizes whose tiles exceed :data:`MAX_CHUNK_TILE`, naming the alternative.

    Raises:
        ValueError: For ``window`` 12 and more.
    """
    if tile(window * window) > MAX_CHUNK_TILE:
        raise ValueError(f"impl 'triton' takes windows of at most {MAX_CHUNK_TILE} tokens ({MAX_CHUNK_TILE}-slot "
                         f"tiles: window <= 11), got window={window}: its tiles would not fit the GPU's shared "
                         "memory; use impl 'fast' or 'math' for this model")


def forward_outputs(q):
    """Empty output (:func:`like_heads_last`) and log-sum-exp ``(B * heads, N)`` (accumulation dtype) of a
    softmax attention's forward kernels."""
    batch, heads, tokens, _ = q.shape
    return like_heads_last(q), q.new_empty(batch * heads, tokens, dtype=acc_dtype(q.dtype))


def backward_buffers(q, k, v, grad_out, lse, local_bias, local_bias_grad, copies=1):
    """What the backward kernels read and write besides the saved tensors.

    Returns:
        tuple: ``grad_out`` in ``q``'s dtype; empty gradients of ``q, k, v``
        (:func:`like_heads_last`); empty ``delta`` like ``lse``; and where
        ``local_bias_grad`` ``copies`` zeroed gradients of ``local_bias`` in the
        accumulation dtype (atomics add to them, see :func:`add_bias_grad`), else None.
    """
    grad_local_bias = None
    if local_bias_grad:
        grad_local_bias = torch.zeros(copies, *local_bias.shape, dtype=lse.dtype, device=q.device)
    return (grad_out.to(q.dtype), like_heads_last(q), like_heads_last(k), like_heads_last(v), torch.empty_like(lse),
            grad_local_bias)


def shared_key_parts(like, parts, keys, with_bias=False):
    """Buffers for the per-chunk partial gradients of shared keys (see :func:`shared_keys_backward`).

    Args:
        like (Tensor): Gives the dtype (the accumulation one) and device.
        parts (int): Programs that write one part each.
        keys (Tensor | None): The shared keys, ``(B, heads, M, d)``.
        with_bias (bool): Whether a per-key bias needs a partial gradient too.

    Returns:
        tuple: Partial gradients of keys, values (``(parts, M, d)``) and bias
        (``(parts, M)``); ``None`` for those not needed.
    """
    if keys is None:
        return None, None, None
    num_keys, head_dim = keys.shape[2:]
    bias_part = like.new_empty(parts, num_keys) if with_bias else None
    return like.new_empty(parts, num_keys, head_dim), like.new_empty(parts, num_keys, head_dim), bias_part


def summed_parts(part, like):
    """A ``(B * heads * chunks, M, d)`` partial gradient summed over the chunks, shaped and typed ``like``."""
    if part is None:
        return None
    batch, heads = like.shape[:2]
    return part.reshape(batch, heads, -1, *part.shape[1:]).sum(2).to(like.dtype)


def cast_like(grad, like):
    """``grad`` in ``like``'s dtype, or None."""
    return None if grad is None else grad.to(like.dtype)


# How many copies of a bias gradient the programs of a backward kernel spread their atomic adds over
# (see add_bias_grad). Every query chunk of every batch element adds to the same table, a few thousand
# to a few ten thousand entries, and atomic adds to one address serialise; 32 copies cut that
# contention 32-fold for 32 times a table's memory (8 MB in fp32 for 3 heads of w = 7, ViL-S's first
# stage). Not yet timed on a GPU: tools/analysis/triton_tuning.py --bias-grad-copies compares values.
BIAS_GRAD_COPIES = 32


def bias_grad_copies(programs):
    """Copies of the bias gradient for a launch of ``programs`` programs: :data:`BIAS_GRAD_COPIES`, at most one
    per program."""
    return min(BIAS_GRAD_COPIES, programs)


def summed_copies(grad, like):
    """The copies of a bias gradient (see :func:`add_bias_grad`) summed, in ``like``'s dtype; or None."""
    return None if grad is None else grad.sum(0).to(like.dtype)


def stand_in(tensor, other):
    """``tensor``, or ``other`` as the pointer argument of an absent one (its kernel branch is compiled out)."""
    return other if tensor is None else tensor


def dot_precision(dtype):
    """tl.dot's input precision: fp32 products in TF32 only where PyTorch's matmuls may use it
    (``torch.set_float32_matmul_precision``); 16-bit inputs ignore it."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() != 'highest':
        return 'tf32'
    return 'ieee' if dtype in (torch.float32, torch.float64) else 'tf32'


def launch_settings(dtype, block_d):
    """Warps and software-pipeline stages of the softmax attention kernels, for inputs in ``dtype`` and
    head-dim tiles of ``block_d``.

    Chosen by the register spills ``ptxas`` reports for sm_90 at the backbones' shapes
    (``tools/analysis/triton_resources.py``, no GPU needed; timings will refine them): with 16-bit
    inputs, 4 warps, and 8 for head-dim tiles of 64, where the query-side backward kernels spill up to
    260 bytes per thread with 4; with fp32 (and fp64) inputs, whose products run on CUDA cores and hold
    more registers, 8 warps and no pipelining of the loads, which keeps the key-side backward kernels
    from spilling up to 8 KB per thread (3 stages) to under 1 KB.
    """
    if dtype.itemsize == 2:
        return dict(num_warps=4 if block_d <= 32 else 8, num_stages=3)
    return dict(num_warps=8, num_stages=1)


def tile(size):
    """Tile side for ``size`` rows: a power of 2, at least :data:`MIN_TILE`."""
    return max(MIN_TILE, triton.next_power_of_2(size))


def strides(tensor, ndim):
    """The tensor's strides, or zeros for an absent tensor (its kernel branch is compiled out)."""
    return tuple(tensor.stride()) if tensor is not None else (0, ) * ndim


def like_heads_last(t):
    """An empty ``(B, h, N, d)`` tensor stored as ``(B, N, h, d)``: the layout the heads are merged from."""
    b, heads, n, d = t.shape
    return t.new_empty(b, n, heads, d).transpose(1, 2)


def acc_dtype(dtype):
    """Accumulation dtype of the kernels for inputs in ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32
