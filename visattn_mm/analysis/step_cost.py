"""What one step of a model costs a GPU, counted on the CPU without one.

A step (forward, or forward + backward) runs on fake tensors (``FakeTensorMode``:
shapes, dtypes and strides, no data), so a batch-8 800x1333 step of a backbone
takes seconds on two cores. Every ATen op the step dispatches is recorded with:

* ``count``: calls; an op that writes no bytes (a view, an ``empty``) is not
  counted as launched (``launched``);
* ``flops``: torch's FLOP formulas (matrix products, convolutions, SDPA kernels;
  elementwise ops count 0; convolution backward with its ``groups``, which
  torch's formula ignores);
* ``bytes_read`` / ``bytes_written``: the distinct elements of the tensor
  arguments (a broadcast dimension read once) and of the outputs that own new
  memory, inputs written in place or ``out=`` arguments (written, not read);
* ``bytes_saved``: tensors autograd keeps for backward, each storage counted once,
  charged to the op that ran last before it was saved;

and the step's ``peak_bytes``: the largest sum of the storages created during the
step that are alive at once (each rounded up to 512 bytes, as CUDA's caching
allocator does), from the op that creates a storage until the storage dies. This
is what ``torch.cuda.max_memory_allocated() - memory_allocated()`` before the step
measures; parameters, their existing gradients and the input are not part of it.
A warm-up step runs first, untraced, so that cached constants (masks, indices) exist
before the step, as after a benchmark's warm-up.

The tensors are CPU ones; the GPU's dispatch decisions are emulated
(``device_type='cuda'``):

* our ops choose their path as for CUDA tensors (:func:`visattn_mm.ops.impl.dispatch_as`),
  so ``'auto'`` takes its CUDA path and ``'triton'`` its custom ops (their fake kernels);
* CUDA autocast's float32 policy on top of CPU autocast: a 16-bit input of
  ``layer_norm``, ``group_norm``, ``exp``, ``pow``, ... is computed in float32,
  ``softmax`` / ``log_softmax`` / ``sum`` / ``cumsum`` / ``prod`` get a float32 result
  (softmax as ``_softmax(half_to_float=True)``), as in PyTorch's CUDA autocast lists;
* CUDA's ``layer_norm`` takes its weight and bias only in its input's dtype (the CPU kernel
  also takes float32 ones with a 16-bit input): a mixed call raises, as on the GPU;
* ``scaled_dot_product_attention`` runs the kernel CUDA picks: with a mask or bias,
  or in float32, the memory-efficient kernel (a boolean mask turned into a bias, a bias
  not aligned to 8 elements padded, then expanded to ``(B, heads, L, S)``); otherwise
  flash attention.

Counting is exact for the program the step runs; time is not counted (kernel
efficiency and host overhead are the device's: measure them on a GPU).
:mod:`visattn_mm.analysis.step_time` turns the counts into an estimate, fitted to measured steps.
``docs/benchmarks.md`` holds the calibration against an H100's measured peaks.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import weakref

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import conv_flop_count, flop_registry

from ..ops.common import clear_device_caches
from ..ops.impl import dispatch_as

aten = torch.ops.aten
AUTOCAST_DTYPES = {'fp32': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}
MODES = ('fwd', 'fwd+bwd')
ALLOCATION_ROUNDING = 512  # bytes; CUDA's caching allocator rounds every block up to this

# Op classes, by ATen op name (the overload packet's); everything else is 'elementwise'.
OP_CLASSES = {
    'layout': (
        'copy_',
        'clone',
        'cat',
        'stack',
        'constant_pad_nd',
        'reflection_pad2d',
        'replication_pad2d',
        'index',
        '_unsafe_index',
        'index_select',
        'gather',
        'scatter',
        'scatter_',
        'scatter_add',
        'scatter_add_',
        'scatter_reduce',
        'scatter_reduce_',
        'index_put',
        'index_put_',
        '_index_put_impl_',
        '_unsafe_index_put',
        'index_add',
        'index_add_',
        'index_copy',
        'index_copy_',
        'index_reduce',
        'index_reduce_',
        'slice_backward',
        'select_backward',
        'narrow_copy',
        'slice_scatter',
        'select_scatter',
        'as_strided_scatter',
        'diagonal_backward',
        'unfold_backward',
        'roll',
        'repeat',
        'flip',
        'expand_copy',
        'permute_copy',
        'im2col',
        'col2im',
        'masked_scatter',
        'masked_scatter_',
        'split_with_sizes_copy',
        'unbind_copy',
        'embedding',
        'embedding_dense_backward',
        'pixel_shuffle',
        'pixel_unshuffle',
        'channel_shuffle',
    ),
    'matmul': ('mm', 'bmm', 'addmm', 'baddbmm', 'addbmm', 'convolution', '_convolution', 'convolution_backward'),
    'attention': (
        '_scaled_dot_product_efficient_attention',
        '_scaled_dot_product_efficient_attention_backward',
        '_scaled_dot_product_flash_attention',
        '_scaled_dot_product_flash_attention_backward',
        '_scaled_dot_product_flash_attention_for_cpu',
        '_scaled_dot_product_flash_attention_for_cpu_backward',
    ),
    'norm': (
        'native_layer_norm',
        'native_layer_norm_backward',
        'native_group_norm',
        'native_group_norm_backward',
        'native_batch_norm',
        'native_batch_norm_backward',
        '_native_batch_norm_legit',
        '_native_batch_norm_legit_functional',
        '_native_batch_norm_legit_no_training',
        'batch_norm_backward',
    ),
    'softmax': ('_softmax', '_softmax_backward_data', '_log_softmax', '_log_softmax_backward_data'),
    'reduction': (
        'sum',
        'mean',
        'amax',
        'amin',
        'max',
        'min',
        'var_mean',
        'var',
        'std',
        'norm',
        'linalg_vector_norm',
        'prod',
        'cumsum',
        'argmax',
        'argmin',
        'logsumexp',
    ),
    'fill': (
        'zeros',
        'zero_',
        'fill_',
        'full',
        'ones',
        'new_zeros',
        'new_ones',
        'new_full',
        'zeros_like',
        'ones_like',
        'full_like',
        'scalar_tensor',
        'arange',
        'linspace',
    ),
}
_CLASS_OF = {name: kind for kind, names in OP_CLASSES.items() for name in names}
# Ops that allocate without writing: no kernel.
_ALLOCATIONS = ('empty', 'empty_like', 'empty_strided', 'new_empty', 'new_empty_strided')

# CUDA autocast's float32 policies beyond CPU autocast's (aten/src/ATen/autocast_mode.cpp): ops whose
# 16-bit floating inputs are computed in float32, and reductions that get ``dtype=float32``.
_FP32_INPUTS = (
    F.layer_norm,
    torch.layer_norm,
    F.group_norm,
    torch.group_norm,
    torch.exp,
    torch.Tensor.exp,
    torch.log,
    torch.Tensor.log,
    torch.log1p,
    torch.Tensor.log1p,
    torch.expm1,
    torch.log2,
    torch.log10,
    torch.pow,
    torch.Tensor.pow,
    torch.Tensor.__pow__,
    torch.rsqrt,
    torch.Tensor.rsqrt,
    torch.reciprocal,
    torch.Tensor.reciprocal,
    torch.acos,
    torch.asin,
    torch.cosh,
    torch.sinh,
    torch.tan,
    torch.erfinv,
    F.softplus,
    torch.cosine_similarity,
    F.cosine_similarity,
    torch.cdist,
    torch.dist,
    torch.logsumexp,
    torch.Tensor.logsumexp,
    F.binary_cross_entropy_with_logits,
    F.l1_loss,
    F.mse_loss,
    F.smooth_l1_loss,
    F.nll_loss,
    F.kl_div,
)
_FP32_RESULT = (
    torch.sum,
    torch.Tensor.sum,
    torch.cumsum,
    torch.Tensor.cumsum,
    torch.prod,
    torch.Tensor.prod,
    torch.cumprod,
    torch.Tensor.cumprod,
)
_SOFTMAXES = {
    F.softmax: aten._softmax,
    torch.softmax: aten._softmax,
    torch.Tensor.softmax: aten._softmax,
    F.log_softmax: aten._log_softmax,
    torch.log_softmax: aten._log_softmax,
    torch.Tensor.log_softmax: aten._log_softmax,
}
# Ops CUDA autocast runs in 16 bits that CPU autocast leaves alone.
_LAYER_NORMS = (F.layer_norm, torch.layer_norm)
_LOW_PRECISION = (torch.einsum, torch.mv, torch.Tensor.mv, torch.addmv, torch.addr, torch.chain_matmul)
_HALVES = (torch.float16, torch.bfloat16)
_TENSOR_BACKWARD = torch.Tensor.backward


@dataclasses.dataclass
class OpCost:
    """What the calls of one op (or op class) cost: see the module docstring."""

    op_class: str = ''
    count: int = 0
    launched: int = 0
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_saved: int = 0

    @property
    def bytes_moved(self):
        return self.bytes_read + self.bytes_written

    def add(self, other):
        for field in ('count', 'launched', 'flops', 'bytes_read', 'bytes_written', 'bytes_saved'):
            setattr(self, field, getattr(self, field) + getattr(other, field))


@dataclasses.dataclass
class StepCost:
    """The costs of one traced step.

    Attributes:
        peak_bytes (int): Peak of live storages created during the step.
        ops (dict[str, OpCost]): Per ATen op name (``namespace::name`` for custom ops).
    """

    peak_bytes: int
    ops: dict

    def by_class(self):
        """``{op class: OpCost}`` summed over the ops of each class."""
        classes = collections.defaultdict(OpCost)
        for cost in self.ops.values():
            classes[cost.op_class].op_class = cost.op_class
            classes[cost.op_class].add(cost)
        return dict(classes)

    def total(self):
        """One :class:`OpCost` summed over every op."""
        total = OpCost(op_class='all')
        for cost in self.ops.values():
            total.add(cost)
        return total

    def summary(self):
        """Flat figures of the step (bytes, FLOPs, launched ops) for tables and tests."""
        total, layout = self.total(), self.by_class().get('layout', OpCost())
        return dict(
            peak_bytes=self.peak_bytes,
            launched=total.launched,
            flops=total.flops,
            bytes_moved=total.bytes_moved,
            bytes_saved=total.bytes_saved,
            layout_bytes=layout.bytes_moved,
            layout_launched=layout.launched,
        )


def _op_name(func):
    namespace = func.namespace
    name = func._schema.name.split('::', 1)[-1]
    return name if namespace == 'aten' else f'{namespace}::{name}'


def _distinct_bytes(tensor):
    """Bytes of the distinct elements a view reads: broadcast (stride-0) dimensions once."""
    elements = math.prod(size for size, stride in zip(tensor.shape, tensor.stride()) if stride != 0)
    return elements * tensor.element_size()


def _storage_key(tensor):
    # ops.common.storage_key's twin: the calibration runs this tracer over older package trees,
    # which lack it (tools/analysis/step_cost_calibration.py).
    return tensor.untyped_storage()._cdata


def _rounded(nbytes):
    return -(-nbytes // ALLOCATION_ROUNDING) * ALLOCATION_ROUNDING


def _op_flops(func, args, kwargs, out):
    packet = func.overloadpacket
    if packet is aten.convolution_backward:
        # torch's formula ignores ``groups``: a depthwise convolution's backward came out ``groups`` times too big.
        grad_out, x, weight = args[:3]
        transposed, mask = args[6], args[-1]
        forward = conv_flop_count(x.shape, weight.shape, grad_out.shape, transposed)
        return forward * (int(mask[0]) + int(mask[1]))
    formula = flop_registry.get(packet)
    return formula(*args, **kwargs, out_val=out) if formula else 0


class _Recorder(TorchDispatchMode):
    """Records every op above the fake-tensor mode (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.defaultdict(OpCost)
        self.live = {}  # storage key -> rounded bytes, for storages created while recording
        self.live_bytes = 0
        self.peak_bytes = 0
        self.saved = set()
        self.last_op = None
        self.last_outputs = set()  # storage keys the last op created
        self.pending_saved = 0  # saved before the op that saves them runs (autograd saves inputs first)

    def _release(self, key):
        self.live_bytes -= self.live.pop(key, 0)

    def _track(self, tensor):
        storage = tensor.untyped_storage()
        key = storage._cdata
        nbytes = _rounded(storage.nbytes())
        self.live[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # `out=` arguments are written, not read (a backward may write its parts into one tensor)
        out_arguments = [
            kwargs[argument.name]
            for argument in func._schema.arguments
            if argument.kwarg_only and argument.alias_info is not None and argument.alias_info.is_write
            if isinstance(kwargs.get(argument.name), torch.Tensor)
        ]
        inputs = [
            t
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and not any(t is written for written in out_arguments)
        ]
        input_keys = {_storage_key(t) for t in inputs}
        cost = self.ops[_op_name(func)]
        name = func.overloadpacket.__name__
        if not cost.op_class:
            cost.op_class = 'attention' if func.namespace == 'visattn_mm' else _CLASS_OF.get(name, 'elementwise')
        cost.bytes_saved += self.pending_saved
        self.pending_saved = 0
        self.last_outputs = set()
        written = 0
        for output in tree_flatten(out)[0]:
            if isinstance(output, torch.Tensor):
                key = _storage_key(output)
                if key not in input_keys and key not in self.live:
                    self._track(output)
                    self.last_outputs.add(key)
                    if name not in _ALLOCATIONS:
                        written += _distinct_bytes(output)
        for argument, value in zip(func._schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, torch.Tensor):
                written += _distinct_bytes(value)
        written += sum(_distinct_bytes(value) for value in out_arguments)
        cost.count += 1
        if written:
            cost.launched += 1
            cost.bytes_written += written
            cost.bytes_read += sum(_distinct_bytes(t) for t in inputs)
            cost.flops += _op_flops(func, args, kwargs, out)
        self.last_op = cost
        return out

    def pack(self, tensor):
        """``saved_tensors_hooks`` pack hook: charges a newly saved activation to the op that saves it, the
        one that made it (an output saved after the op ran) or else the next one (inputs are saved before)."""
        key = _storage_key(tensor)
        if key in self.live and key not in self.saved:
            self.saved.add(key)
            if key in self.last_outputs:
                self.last_op.bytes_saved += tensor.untyped_storage().nbytes()
            else:
                self.pending_saved += tensor.untyped_storage().nbytes()
        return tensor


def _check_layer_norm_dtypes(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    for name, param in (('weight', weight), ('bias', bias)):
        if param is not None and param.dtype != input.dtype:
            raise RuntimeError(
                f'expected scalar type {input.dtype} but found {param.dtype}: CUDA\'s layer_norm takes its '
                f'{name} only in its input\'s dtype (the CPU kernel accepts {param.dtype}); cast it'
            )


def _cast_halves(values, dtype):
    return [
        v.to(dtype)
        if isinstance(v, torch.Tensor) and v.dtype in _HALVES + (torch.float32,) and v.is_floating_point()
        else v
        for v in values
    ]


class CudaDispatchEmulation(TorchFunctionMode):
    """CUDA's autocast policies beyond CPU autocast's, and CUDA's SDPA kernel choice (module docstring)."""

    def __init__(self, autocast_dtype):
        super().__init__()
        self.autocast_dtype = autocast_dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        autocasting = self.autocast_dtype is not None and torch.is_autocast_enabled('cpu')
        if func is F.scaled_dot_product_attention:
            return self._sdpa(*args, **kwargs)
        if func is _TENSOR_BACKWARD:
            with self:  # backward's recomputations (checkpoints) run under the same emulation
                return _run_backward(*args, **kwargs)
        if func in _LAYER_NORMS and not (autocasting and args[0].dtype in _HALVES):
            _check_layer_norm_dtypes(*args, **kwargs)
        if not autocasting:
            return func(*args, **kwargs)
        halves = any(isinstance(a, torch.Tensor) and a.dtype in _HALVES for a in args)
        if func in _SOFTMAXES and halves and kwargs.get('dtype') is None and len(args) < 3:
            tensor, dim = args[0], (args[1] if len(args) > 1 else kwargs['dim'])
            return _SOFTMAXES[func](tensor, dim, True)
        if func in _FP32_RESULT and halves and 'dtype' not in kwargs:
            return func(*args, **kwargs, dtype=torch.float32)
        if func in _FP32_INPUTS and halves:
            with torch.autocast('cpu', enabled=False):
                return func(*_cast_halves(args, torch.float32), **kwargs)
        if func in _LOW_PRECISION:
            with torch.autocast('cpu', enabled=False):
                return func(*_cast_halves(args, self.autocast_dtype), **kwargs)
        return func(*args, **kwargs)

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if enable_gqa or is_causal:
            raise NotImplementedError('step_cost: SDPA with is_causal or enable_gqa is not emulated')
        if self.autocast_dtype is not None and torch.is_autocast_enabled('cpu'):
            query, key, value = _cast_halves((query, key, value), self.autocast_dtype)
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(self.autocast_dtype)
        with torch.autocast('cpu', enabled=False):
            needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            if attn_mask is None and query.dtype in _HALVES:
                return aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, False, False, scale=scale
                )[0]
            if attn_mask is not None:
                if attn_mask.dtype == torch.bool:
                    attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill(~attn_mask, -math.inf)
                last = attn_mask.shape[-1]
                aligned = all(stride % 8 == 0 for stride in attn_mask.stride()[:-1])
                if not aligned:
                    attn_mask = F.pad(attn_mask, (0, (-last) % 8))[..., :last]
                attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            return aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, needs_grad, dropout_p, False, scale=scale
            )[0]


def _run_backward(tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    # The engine itself, so that the torch-function mode stays on for what backward runs in Python.
    gradient = torch.ones_like(tensor) if gradient is None else gradient
    torch.autograd.Variable._execution_engine.run_backward(
        (tensor,),
        (gradient,),
        bool(retain_graph or create_graph),
        create_graph,
        tuple(inputs or ()),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def output_loss(outputs):
    """Sum of the means of every floating tensor in ``outputs`` (nested tuples, lists, dicts), in float32."""
    tensors = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise ValueError('the model returned no floating-point tensor to take a loss of')
    return sum(t.float().mean() for t in tensors)


def _to_fake(module, fake_mode):
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                sub._parameters[name] = torch.nn.Parameter(fake_mode.from_tensor(param), param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = fake_mode.from_tensor(buffer)


def trace_step(model, input_shape, dtype='bf16', mode='fwd+bwd', device_type='cuda', forward=None, loss=output_loss):
    """Counts one step of ``model`` on a fake input of ``input_shape`` (see the module docstring).

    The model's parameters and buffers are replaced by fake tensors: use a model built for this.

    Args:
        model (nn.Module): On the CPU, in the train/eval state the step should run in.
        input_shape (tuple[int, ...]): E.g. ``(8, 3, 800, 1333)``; the input is float32.
        dtype (str): 'fp32', or 'bf16' / 'fp16' for autocast. Default: 'bf16'.
        mode (str): 'fwd' (no autograd) or 'fwd+bwd' (backward of ``loss``). Default: 'fwd+bwd'.
        device_type (str): 'cuda' emulates CUDA's dispatch decisions; 'cpu' runs the CPU's. Default: 'cuda'.
        forward (callable, optional): ``forward(model, images) -> outputs``; default ``model(images)``.
        loss (callable): ``loss(outputs) -> scalar`` for backward. Default: :func:`output_loss`.

    Returns:
        StepCost: the counts of the step.
    """
    if dtype not in AUTOCAST_DTYPES:
        raise ValueError(f'dtype {dtype!r}: choose from {list(AUTOCAST_DTYPES)}')
    if mode not in MODES:
        raise ValueError(f'mode {mode!r}: choose from {list(MODES)}')
    if device_type not in ('cuda', 'cpu'):
        raise ValueError(f"device_type {device_type!r}: 'cuda' (emulated) or 'cpu'")
    forward = forward or (lambda net, images: net(images))
    autocast_dtype = AUTOCAST_DTYPES[dtype]
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    _to_fake(model, fake_mode)
    with fake_mode:
        images = torch.empty(input_shape)

    def step(recorder=None):
        hooks = (
            torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t)
            if recorder
            else contextlib.nullcontext()
        )
        grad = torch.enable_grad() if mode == 'fwd+bwd' else torch.no_grad()
        with grad, hooks:
            with torch.autocast('cpu', dtype=autocast_dtype, enabled=autocast_dtype is not None):
                result = loss(forward(model, images)) if mode == 'fwd+bwd' else forward(model, images)
            if mode == 'fwd+bwd':
                result.backward()
        del result
        model.zero_grad(set_to_none=True)

    emulation = contextlib.ExitStack()
    clear_device_caches()
    try:
        with emulation, fake_mode:
            if device_type == 'cuda':
                emulation.enter_context(dispatch_as('cuda'))
                emulation.enter_context(CudaDispatchEmulation(autocast_dtype))
            step()  # warm-up: cached constants exist before the step
            recorder = _Recorder()
            with recorder:
                step(recorder)
    finally:
        clear_device_caches()  # the caches hold fake tensors now
    return StepCost(peak_bytes=recorder.peak_bytes, ops=dict(recorder.ops))
