"""Host side of the Triton attention kernels (``impl='triton'``), shared by the ops.

Registration of a kernel pair as custom ops (:func:`define_op`), launching and
counting kernels (:func:`launch`), launch settings, tile sizes and dtypes, the
buffers and reductions around the kernels, and the checks of what the kernels
support; the device functions they call are in :mod:`visattn_mm.ops.triton.kernel_parts`.

The kernels run on CUDA tensors; :func:`check_device` lets CPU tensors through
where Triton's interpreter runs them (:func:`~visattn_mm.ops.impl.triton_interpreted`,
the one flag that also steers the ops' choice of path).
"""

import contextlib
import inspect
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import impl, tuned_launches
from ..cuda_defaults import DTYPE_NAMES
from ..process_state import STATE

# Smallest tile side: tl.dot needs at least 16 rows, columns and depth on GPUs.
MIN_TILE = 16


class HeadRows(NamedTuple):
    """A ``(B, heads, N, d)`` tensor as a kernel argument: the tensor and its strides, one argument
    however many the kernel reads (:func:`~visattn_mm.ops.triton.kernel_parts.load_rows`)."""

    ptr: torch.Tensor
    batch: int
    head: int
    row: int
    dim: int


class BiasTable(NamedTuple):
    """A ``(heads, queries, keys)`` bias as a kernel argument: the tensor and its strides. A per-key bias
    ``(heads, keys)`` is a table whose query stride is 0."""

    ptr: torch.Tensor
    head: int
    query: int
    key: int


def head_rows(tensor, absent=None):
    """``tensor`` as :class:`HeadRows`; for an absent one (None) ``absent`` with zero strides, a pointer
    its kernel never reads (the branch is compiled out)."""
    if tensor is None:
        return HeadRows(absent, 0, 0, 0, 0)
    return HeadRows(tensor, *tensor.stride())


def bias_table(bias, absent):
    """``bias`` (``(heads, queries, keys)`` or ``(heads, keys)``) as :class:`BiasTable`; for an absent one
    (None) ``absent`` with zero strides, as in :func:`head_rows`."""
    if bias is None:
        return BiasTable(absent, 0, 0, 0)
    if bias.dim() == 2:
        return BiasTable(bias, bias.stride(0), 0, bias.stride(1))
    return BiasTable(bias, *bias.stride())


def tensor_args(args):
    """The tensors (whatever has a device) among a kernel launch's arguments, those inside
    :class:`HeadRows` and :class:`BiasTable` included."""
    for arg in args:
        if isinstance(arg, tuple):
            yield from tensor_args(arg)
        elif hasattr(arg, 'device'):
            yield arg


def constant_bundle(bundle):
    """``bundle``, a named tuple of a kernel's compile-time constants passed as one ``tl.constexpr`` argument,
    with every member wrapped in ``tl.constexpr`` (a named tuple inside it in :class:`_ConstantTuple`).

    The compiled kernel reads a member as it is: a plain str or tuple reaching a jitted function's parameter
    fails to compile on Triton 3.6's launch path ("'str' object has no attribute 'type'";
    ``tests/triton_harness.py``'s ``compiling_launches`` goes through that path), and a shape such as
    ``[4 * tile.BLOCK_D]`` built from plain ints fails on 3.6 and 3.7 alike.
    """
    return type(bundle)(*(_ConstantTuple(v) if isinstance(v, tuple) else tl.constexpr(v) for v in bundle))


class _ConstantTuple(tl.constexpr):
    """A named tuple as a ``tl.constexpr`` whose fields read as the tuple's (``shared.GLOBAL.NUM``) in the
    interpreter too, where kernels are plain Python (compiled kernels unwrap a constexpr before reading)."""

    def __getattr__(self, name):  # only for names the constexpr itself lacks
        if name.startswith('_') or 'value' not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.value, name)


def launch_tiles(constexprs):
    """``(head-dim tile, token tile)`` of a launch's constexprs, given one by one or bundled in a ``tile``
    named tuple (the analysis tools label launches with them)."""
    names = dict(constexprs)
    if 'tile' in names:
        names.update(names.pop('tile')._asdict())
    head_tile, token_tile = names['BLOCK_D'], names.get('BLOCK', names.get('BLOCK_N'))
    return tuple(getattr(size, 'value', size) for size in (head_tile, token_tile))  # unwrapped (constant_bundle)


def launch(kernel, grid, settings, *args, **constexprs):
    """Counts and launches ``kernel`` with its :func:`tuned_settings` on the device of its first tensor
    argument; tests and ``tools/analysis/triton_resources.py`` replace this to compile without a GPU (and
    call :func:`tuned_settings` too)."""
    STATE.kernel_launches[kernel.fn.__name__] += 1
    with on_device(next(tensor_args(args)).device):
        kernel[grid](*args, **tuned_settings(kernel, settings, args, constexprs), **constexprs)


def tuned_settings(kernel, settings, args, constexprs):
    """What a launch of ``kernel`` runs with: the row of :mod:`visattn_mm.ops.tuned_launches` for the kernel,
    the dtype of its first tensor argument and its head-dim tile, where a GPU measured one; otherwise
    ``settings`` (the op's, from :func:`launch_settings`)."""
    table = tuned_launches.TUNED_LAUNCHES
    if not table:  # no GPU has tuned: nothing to look up (a launch's host time counts at small batches)
        return settings
    return table.get((kernel.fn.__name__, input_dtype(args), launch_tiles(constexprs)[0]), settings)


def input_dtype(args):
    """The name of the dtype of a launch's first tensor argument (``'bf16'``), the tuned table's key; None for
    another dtype (fp64)."""
    return DTYPE_NAMES.get(next(tensor_args(args)).dtype)


def on_device(device):
    """Makes a CUDA ``device`` the current one inside: Triton launches on the current device and stream,
    which need not be the tensors' (a model on ``cuda:1`` in a process whose current device is 0)."""
    return torch.cuda.device(device) if device.type == 'cuda' else contextlib.nullcontext()


def backward_schema(forward, backward, num_tensor_inputs):
    """The schema of a kernel pair's backward op, from ``forward``'s annotations (its schema): ``grad_out``,
    the forward's tensor inputs, its outputs (tensors, named as ``backward``'s parameters name them), its
    other arguments, then ``needs_grad``; a list of tensors out. So the types are written once."""
    arguments = torch.library.infer_schema(forward, mutates_args=()).split(') -> ')[0][1:].split(', ')
    names = list(inspect.signature(backward).parameters)
    outputs = names[1 + num_tensor_inputs : len(names) - 1 - (len(arguments) - num_tensor_inputs)]
    parts = [
        'Tensor grad_out',
        *arguments[:num_tensor_inputs],
        *(f'Tensor {name}' for name in outputs),
        *arguments[num_tensor_inputs:],
        'bool[] needs_grad',
    ]
    return f'({", ".join(parts)}) -> Tensor[]'


class QKV(NamedTuple):
    """The tensor inputs of an op that has no others (Pale, vicinity attention)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


def define_op(name, forward, backward, tensor_inputs, forward_fake=None):
    """Registers a kernel pair as the custom ops ``visattn_mm::<name>`` and
    ``visattn_mm::<name>_backward``, linked by an autograd formula.

    As custom ops, the kernel launches are one opaque node per direction for
    torch.compile: Dynamo and AOTAutograd take the output shapes from the fake
    functions and never trace into Triton (``tests/test_ops/test_compile.py``).

    Args:
        name (str): The op's name in the ``visattn_mm`` namespace.
        forward (callable): ``(tensor inputs..., geometry...) -> (out, *saved)``,
            with type annotations (they are the op's schema). The first three
            tensor inputs are ``q, k, v``; the others may be None.
        backward (callable): ``(grad_out, tensor inputs..., forward outputs...,
            geometry..., needs_grad) -> list[Tensor]``, not annotated: its schema is
            ``forward``'s (:func:`backward_schema`); ``needs_grad`` holds ``needs_input_grad``
            of the tensor inputs; the result comes from :func:`gradient_list`.
        tensor_inputs (type): The named tuple of the op's tensor inputs (``q, k, v`` first): the leading
            arguments of ``forward`` and ``backward`` (after ``grad_out``) have its field names.
        forward_fake (callable, optional): ``forward``'s outputs as empty tensors, from the
            same arguments. Default: a softmax attention's, :func:`forward_outputs` of ``q``.

    Returns:
        The forward op: call it with ``forward``'s arguments; it returns ``(out, *saved)``.

    Raises:
        TypeError: Where ``forward``'s or ``backward``'s leading arguments are not ``tensor_inputs``' fields.
    """
    fields = list(tensor_inputs._fields)
    num_tensor_inputs = len(fields)
    for function, first in ((forward, 0), (backward, 1)):
        names = list(inspect.signature(function).parameters)[first : first + num_tensor_inputs]
        if names != fields:
            raise TypeError(f'{function.__qualname__} takes {names} where {tensor_inputs.__name__} has {fields}')
    forward_op = torch.library.custom_op(f'visattn_mm::{name}', forward, mutates_args=())
    forward_op.register_fake(forward_fake or (lambda q, *_: forward_outputs(q)))
    backward_op = torch.library.custom_op(
        f'visattn_mm::{name}_backward',
        backward,
        mutates_args=(),
        schema=backward_schema(forward, backward, num_tensor_inputs),
    )

    @backward_op.register_fake
    def _(grad_out, *args):
        inputs, needs_grad = args[:num_tensor_inputs], args[-1]
        empty = [
            like_heads_last(t) if i < 3 else t if t is None else t.new_empty(t.shape) for i, t in enumerate(inputs)
        ]
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
        return (*(g if want else None for g, want in zip(grads, wanted)), *(None,) * len(ctx.geometry))

    forward_op.register_autograd(differentiate, setup_context=setup_context)
    return forward_op


class SharedKeys(NamedTuple):
    """The compile-time constants of one set of keys that every query of a chunk sees (global tokens,
    projected keys), which ``kernel_parts.shared_keys_forward`` and ``shared_keys_backward`` read.

    Args:
        NUM (int): How many (0: none; the kernels skip the set).
        HAS_BIAS (bool): Whether their logits have a bias, one per key and head.
        BLOCK (int): Key slots of their tile.
    """

    NUM: int
    HAS_BIAS: bool
    BLOCK: int


def shared_key_constants(count, has_bias=False):
    """:class:`SharedKeys` of ``count`` keys (their tile: :func:`tile`)."""
    return SharedKeys(count, has_bias, tile(count))


class LaunchPlan(NamedTuple):
    """What every kernel launch of one call of a local-window softmax op shares.

    Args:
        grid (tuple[int, int]): ``(query chunks, batch * heads)``.
        geometry (tuple[int, ...]): The map's sizes as one kernel argument.
        tile (tuple): The op's compile-time constants, which all three kernels take as ``tile``
            (:func:`constant_bundle` of the op's named tuple).
        shared (tuple): Those of the shared (global, projected) keys, which the forward and the
            query-side backward kernel take as ``shared``.
        settings (dict): ``num_warps`` and ``num_stages`` (:func:`launch_settings`).
        key_tiles (int): The tiles of local keys each query chunk loops over (its neighbour chunks, its
            patch's tiles): the bias-gradient kernel's first grid axis.
    """

    grid: tuple
    geometry: tuple
    tile: tuple
    shared: tuple
    settings: dict
    key_tiles: int

    @property
    def programs(self):
        """Programs of each launch (query chunks times ``batch * heads``)."""
        return self.grid[0] * self.grid[1]


class WindowSoftmaxKernels(NamedTuple):
    """The kernels of a local-window softmax op (sliding chunk, long-short), which
    :func:`window_softmax_forward` and :func:`window_softmax_backward` launch. Their arguments, in order:

    * ``forward``: the inputs as one tuple (:func:`head_rows` of ``q, k, v``, then the op's other tensors,
      the local bias as a :func:`bias_table` at the index the op names), ``out`` rows, ``lse``, geometry;
    * ``backward_queries``: the inputs, ``out`` and ``grad_out`` rows, ``lse``, ``delta``, ``grad_q``
      rows, the local bias gradient, the shared keys' partial gradients as one tuple, geometry, the
      bias gradient's copies;
    * ``backward_keys``: ``q, k, v`` rows, the local bias table, ``grad_out`` rows, ``lse``, ``delta``,
      ``grad_k`` and ``grad_v`` rows, geometry;
    * ``bias_grad``: the inputs, ``grad_out`` rows, ``lse``, ``delta``, the local bias gradient's parts,
      geometry, the query chunks per image, the (batch, query chunk) pairs (see :func:`bias_grad_parts`).
    """

    forward: object
    backward_queries: object
    backward_keys: object
    bias_grad: object


def window_softmax_forward(kernels, plan, q, input_args):
    """Launches ``kernels.forward``: the output and the log-sum-exp of each query's logits, ``(B * heads, N)``."""
    out, lse = forward_outputs(q)
    launch(
        kernels.forward,
        plan.grid,
        plan.settings,
        tuple(input_args),
        head_rows(out),
        lse,
        plan.geometry,
        tile=plan.tile,
        shared=plan.shared,
    )
    return out, lse


def window_softmax_backward(kernels, plan, inputs, input_args, grad_out, out, lse, needs_grad, shared_grads):
    """Launches the two backward kernels of a local-window softmax op.

    Args:
        kernels (WindowSoftmaxKernels): The op's kernels.
        plan (LaunchPlan): The call's launch plan.
        inputs (NamedTuple): The op's tensor inputs (its ``define_op`` named tuple: ``q, k, v`` first, a
            ``local_bias``).
        input_args (NamedTuple): ``inputs`` as the kernels take them, in the same named tuple.
        grad_out, out, lse (Tensor): The output's gradient, the output and the log-sum-exp.
        needs_grad (list[bool]): Which of ``inputs`` need a gradient.
        shared_grads (tuple): Buffers of the shared keys' partial gradients (None: not needed), which
            the query-side kernel writes and the op sums.

    Returns:
        tuple: The gradients of ``q, k, v`` and of the local bias (None where not wanted).
    """
    q, k, v, local_bias = inputs.q, inputs.k, inputs.v, inputs.local_bias
    local_bias_grad = gradient_wanted(inputs._fields.index('local_bias'), inputs, needs_grad)
    copies = bias_grad_copies(plan.programs)
    atomic_bias_grad = local_bias_grad and copies > 0  # else bias_grad_parts, after both kernels
    grad_out, grad_q, grad_k, grad_v, delta, grad_local_bias = backward_buffers(
        q, k, v, grad_out, lse, local_bias, atomic_bias_grad, copies
    )
    grad_out_rows = head_rows(grad_out)
    launch(
        kernels.backward_queries,
        plan.grid,
        plan.settings,
        tuple(input_args),
        head_rows(out),
        grad_out_rows,
        lse,
        delta,
        head_rows(grad_q),
        stand_in(grad_local_bias, lse),
        tuple(stand_in(grad, lse) for grad in shared_grads),
        plan.geometry,
        copies,
        LOCAL_BIAS_GRAD=atomic_bias_grad,
        tile=plan.tile,
        shared=plan.shared,
    )
    launch(
        kernels.backward_keys,
        plan.grid,
        plan.settings,
        input_args.q,
        input_args.k,
        input_args.v,
        input_args.local_bias,
        grad_out_rows,
        lse,
        delta,
        head_rows(grad_k),
        head_rows(grad_v),
        plan.geometry,
        tile=plan.tile,
    )
    if local_bias_grad and not atomic_bias_grad:
        grad_local_bias = bias_grad_parts(kernels.bias_grad, plan, input_args, grad_out_rows, lse, delta, local_bias)
    return grad_q, grad_k, grad_v, summed_copies(grad_local_bias, local_bias)


def bias_grad_parts(kernel, plan, input_args, grad_out_rows, lse, delta, local_bias):
    """Launches an op's ``bias_grad`` kernel (see :func:`bias_grad_copies`): the local bias gradient in
    parts, ``(parts, *local_bias.shape)`` in the accumulation dtype, to be summed over the parts.

    One program per key tile, head and part: :data:`BIAS_GRAD_PROGRAMS` programs or fewer, set by the shapes
    alone, so that a shape is summed in the same order on every run. Zeroed: the key tiles of a shift mode
    that skips neighbour chunks write no part of their columns.
    """
    heads = local_bias.shape[0]
    pairs = plan.programs // heads
    parts = max(1, min(pairs, BIAS_GRAD_PROGRAMS // (plan.key_tiles * heads)))
    grad_parts = torch.zeros(parts, *local_bias.shape, dtype=lse.dtype, device=lse.device)
    launch(
        kernel,
        (plan.key_tiles, heads, parts),
        plan.settings,
        tuple(input_args),
        grad_out_rows,
        lse,
        delta,
        grad_parts,
        plan.geometry,
        plan.grid[0],
        pairs,
        tile=plan.tile,
    )
    return grad_parts


def gradient_wanted(index, inputs, needs_grad):
    """Whether the backward op returns the gradient of tensor input ``index``: always for ``q, k, v``
    (their kernels write it anyway), for the others where given and needed."""
    return index < 3 or (inputs[index] is not None and needs_grad[index])


def gradient_list(grads, inputs, needs_grad):
    """The backward op's result: per tensor input its gradient where :func:`gradient_wanted` (for
    ``q, k, v`` stored as :func:`like_heads_last`, for the others contiguous), else an empty
    placeholder (a custom op returns no None)."""
    return [grad if gradient_wanted(i, inputs, needs_grad) else inputs[0].new_empty(0) for i, grad in enumerate(grads)]


def check_supported(op, q, tokens, window=None, dropout_p=0.0):
    """Refuses what the kernels of ``op`` cannot run (:func:`~visattn_mm.ops.impl.can_run_triton`: attention
    dropout, too large windows or head dims), naming the alternative, and another token count than the map's.

    Args:
        op (str): The op's name in :data:`~visattn_mm.ops.specs.OPS`.
        q (Tensor): ``(B, heads, N, d)`` queries.
        tokens (int): ``N`` the map has (``height * width``).
        window (int, optional): The chunk (segment) size, where the op has one.
        dropout_p (float): Attention dropout asked for.

    Raises:
        ValueError: For what the kernels cannot run or another token count.
    """
    impl.can_run_triton(op, q, window=window, dropout_p=dropout_p, raise_error=True)
    if q.shape[2] != tokens:
        raise ValueError(f'q has {q.shape[2]} tokens, not height * width = {tokens}')


def check_device(q, alternative="impl 'fast' or 'math'"):
    """Refuses tensors that are not on a CUDA device, naming the ``alternative``, unless Triton's interpreter
    is on (then the kernels run on CPU tensors).

    Raises:
        RuntimeError: For such tensors.
    """
    if impl.dispatch_device_type(q.device.type) != 'cuda' and not impl.triton_interpreted():
        raise RuntimeError(
            f"impl 'triton' runs on CUDA tensors, got {q.device.type} ones; use {alternative} there "
            "(TRITON_INTERPRET=1 set before visattn_mm's Triton kernels are imported runs them on the CPU, "
            'slowly, for tests)'
        )


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
            raise ValueError(
                f'{name} has shape {tuple(tensor.shape)}, not (B, heads, M, d) = '
                f'({batch}, {heads}, {keys.shape[2]}, {head_dim}) like q'
            )
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
        accumulation dtype (atomics add to them, see
        :func:`~visattn_mm.ops.triton.kernel_parts.add_bias_grad`), else None.
    """
    grad_local_bias = None
    if local_bias_grad:
        grad_local_bias = torch.zeros(copies, *local_bias.shape, dtype=lse.dtype, device=q.device)
    return (
        grad_out.to(q.dtype),
        like_heads_last(q),
        like_heads_last(k),
        like_heads_last(v),
        torch.empty_like(lse),
        grad_local_bias,
    )


def shared_key_parts(like, parts, keys, with_bias=False):
    """Buffers for the per-chunk partial gradients of shared keys (see
    :func:`~visattn_mm.ops.triton.kernel_parts.shared_keys_backward`).

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
# (see kernel_parts.add_bias_grad). Every query chunk of every batch element adds to the same table, a few thousand
# to a few ten thousand entries, and atomic adds to one address serialise; 32 copies cut that
# contention 32-fold for 32 times a table's memory (8 MB in fp32 for 3 heads of w = 7, ViL-S's first
# stage). 0: no atomics, a kernel of its own sums the gradient (bias_grad_parts), the same bits on every
# run, at the price of two more tile products per score. Not yet timed on a GPU:
# tools/analysis/triton_tuning.py --bias-grad-copies compares values, 0 among them.
BIAS_GRAD_COPIES = 32
# The programs of a bias-gradient kernel without atomics (bias_grad_parts): a few per SM of an H100 (132).
BIAS_GRAD_PROGRAMS = 512


def bias_grad_copies(programs):
    """Copies of the bias gradient for a launch of ``programs`` programs: :data:`BIAS_GRAD_COPIES`, at most one
    per program; 0 (no atomics: :func:`bias_grad_parts`) where :data:`BIAS_GRAD_COPIES` is 0 or where
    ``torch.use_deterministic_algorithms`` is on (atomics would let the sum's last bits vary between runs)."""
    if torch.are_deterministic_algorithms_enabled():
        return 0
    return min(BIAS_GRAD_COPIES, programs)


def summed_copies(grad, like):
    """The copies of a bias gradient (see :func:`~visattn_mm.ops.triton.kernel_parts.add_bias_grad`) summed,
    in ``like``'s dtype; or None."""
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


def launch_settings(dtype):
    """Warps and software-pipeline stages of the softmax attention kernels, for inputs in ``dtype``.

    With 16-bit inputs, 4 warps and 3 stages at every head dim. Eight warps are wrong on Hopper at head-dim
    tiles of 64 (Triton 3.6, H100 and H200, 2026-11-26): the sliding-chunk forward then computes wrong
    outputs on a map smaller than its chunk and reads outside its shared memory on larger ones
    (compute-sanitizer: "out-of-range shared or local address" at the ``q k^T`` product of
    ``kernel_parts.key_tile``), whatever the stages; 4 warps were right in every case (docs/benchmarks_history.md,
    "GPU sessions"). The price is some register spills in the query-side backward kernels at head dim 64 (about 150
    bytes per thread by ``tools/analysis/triton_resources.py``). With fp32 (and fp64) inputs, whose products
    run on CUDA cores and hold more registers, 8 warps and no pipelining of the loads, which keeps the
    key-side backward kernels from spilling up to 8 KB per thread (3 stages) to under 1 KB; the GPU tests
    passed with them.
    """
    if dtype.itemsize == 2:
        return dict(num_warps=4, num_stages=3)
    return dict(num_warps=8, num_stages=1)


def tile(size):
    """Tile side for ``size`` rows: a power of 2, at least :data:`MIN_TILE`."""
    return max(MIN_TILE, triton.next_power_of_2(size))


def like_heads_last(t):
    """An empty ``(B, h, N, d)`` tensor stored as ``(B, N, h, d)``: the layout the heads are merged from."""
    b, heads, n, d = t.shape
    return t.new_empty(b, n, heads, d).transpose(1, 2)


def acc_dtype(dtype):
    """Accumulation dtype of the kernels for inputs in ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32
