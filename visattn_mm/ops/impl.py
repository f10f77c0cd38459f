"""The attention paths an op can run, and the one place that says what each value of ``impl`` /
``attn_impl`` runs (the ops' and backbones' docstrings refer here).

Every softmax attention op in this package has two torch implementations computing the same
function, and Triton kernels:

* ``'math'``: explicit ``logits -> softmax (fp32) -> @ v`` over the gathered
  neighbours; the reference the fast path is tested against.
* ``'fast'``: the neighbours go through
  :func:`torch.nn.functional.scaled_dot_product_attention`, whose fused
  kernels never store the attention scores for backward.
* ``'auto'`` (default): on CUDA, what the op's row of the defaults table
  (:mod:`visattn_mm.ops.cuda_defaults`, by dtype and head dim) says a GPU
  measured best, ``'fast'`` until a GPU has measured it; on the CPU, whichever
  of the two measured faster, by whether a bias needs a gradient (see
  ``FUSED_DEVICES`` and :func:`chosen_path`).
* ``'triton'``: Triton kernels that store neither gathered neighbours nor
  logits, for every op of :mod:`visattn_mm.ops.specs` on CUDA tensors
  (``visattn_mm.ops.<op>.triton``); other devices take the path 'auto' picks.
  What the kernels cannot run (attention dropout, and each op's
  :class:`~visattn_mm.ops.specs.TritonLimits`) :func:`can_run_triton` refuses, naming the
  reason: an error where 'triton' was asked for, a warning (once per reason) where 'auto'
  picked it and runs 'fast' instead.

Vicinity attention (:mod:`visattn_mm.ops.vicinity`) has no softmax and is
linear by construction: 'auto', 'fast' and 'math' run its one torch path; 'triton'
runs its Triton kernels (in at least fp32) on CUDA tensors, the torch path elsewhere.
The precision of its torch-path products is a choice of its own (VVT's
``bf16_products``), not of the implementation.

The choice is made per model: the backbones' ``attn_impl`` argument, passed to
every op as ``impl``. An explicit value ('fast', 'math', 'triton') is what runs; a
process-wide selection decides what 'auto' resolves to (for benchmarks and tests, as
NATTEN's global setting steers only its automatic choice): :func:`set_attention_impl`,
the :func:`attention_impl` context manager, or the ``VISATTN_ATTENTION_IMPL``
environment variable read at import.
"""

import contextlib
import os

import torch

from .cuda_defaults import cuda_default
from .process_state import STATE
from .specs import OPS, op_spec

ATTENTION_IMPLS = ('auto', 'fast', 'math', 'triton')
ENV_VAR = 'VISATTN_ATTENTION_IMPL'

# Device types besides CUDA (whose 'auto' follows ops/cuda_defaults.py) on which 'auto' picks the
# fused path. Measured on CPU (torch 2.12, forward + backward, stage-1 shapes; rerun with
# tools/analysis/attention_benchmark.py): unless a bias needs a gradient (see chosen_path), the
# fused path is faster for all three softmax attentions, and for Pale it turns the N^1.5 memory of
# the stored scores into linear memory.
FUSED_DEVICES = ('cpu',)


# What each choice runs, for the log line a backbone writes at build (describe_impl): for the
# softmax attentions, and for vicinity attention (no softmax: its torch ops or its Triton kernels).
SOFTMAX_SUMMARIES = dict(
    auto="per device: on CUDA the defaults table's path per op and dtype (visattn_mm.ops.cuda_defaults; "
    "'fast' until a GPU has measured 'triton' faster), on the CPU the fused softmax kernels ('fast'), or the "
    'explicit softmax when a bias needs its gradient',
    fast='the fused softmax kernels of scaled_dot_product_attention',
    math='the explicit softmax (the reference)',
    triton="Triton kernels on CUDA, 'auto' elsewhere",
)
VICINITY_SUMMARIES = dict(
    auto='vicinity attention in torch ops, or on CUDA its Triton kernels where the defaults table says so',
    fast='vicinity attention in torch ops',
    math='vicinity attention in torch ops',
    triton='vicinity attention in Triton kernels on CUDA, torch ops elsewhere',
)


def _checked(name):
    if name not in ATTENTION_IMPLS:
        raise ValueError(f'unknown attention implementation {name!r}; allowed values are {ATTENTION_IMPLS}')
    return name


STATE.attention_impl = STATE.default_attention_impl = _checked(os.environ.get(ENV_VAR, 'auto'))


def get_attention_impl():
    """Returns the selected implementation name (one of :data:`ATTENTION_IMPLS`)."""
    return STATE.attention_impl


def set_attention_impl(name):
    """Selects what 'auto' resolves to, process-wide (explicit choices are kept).

    Args:
        name (str): One of :data:`ATTENTION_IMPLS`.

    Raises:
        ValueError: for any other name.
    """
    STATE.attention_impl = _checked(name)


@contextlib.contextmanager
def attention_impl(name):
    """Context manager selecting what 'auto' resolves to, restoring the previous selection.

    Args:
        name (str): One of :data:`ATTENTION_IMPLS`.
    """
    previous = get_attention_impl()
    set_attention_impl(name)
    try:
        yield
    finally:
        set_attention_impl(previous)


def resolve_impl(impl='auto'):
    """The implementation in force for an op asked to use ``impl``.

    An explicit ``impl`` is kept; 'auto' becomes the process-wide selection
    (:func:`set_attention_impl`, :func:`attention_impl`, ``VISATTN_ATTENTION_IMPL``).

    Raises:
        ValueError: If ``impl`` is not one of :data:`ATTENTION_IMPLS`.
    """
    return STATE.attention_impl if _checked(impl) == 'auto' else impl


def summarize_impl(impl, softmax=True, vicinity=True):
    """What ``impl`` runs, for a model with softmax attentions and / or vicinity attention."""
    parts = ([SOFTMAX_SUMMARIES[impl]] if softmax else []) + ([VICINITY_SUMMARIES[impl]] if vicinity else [])
    return '; '.join(parts)


def describe_impl(impl, softmax=True, vicinity=True):
    """One line saying what ``impl`` computes (for a model with softmax attentions and / or vicinity
    attention), and what a process-wide selection makes of 'auto', if any."""
    line = f'attn_impl={_checked(impl)!r}: {summarize_impl(impl, softmax, vicinity)}'
    selected = STATE.attention_impl
    if impl == 'auto' and selected != 'auto':
        line += f'; selected process-wide: {selected!r}: {summarize_impl(selected, softmax, vicinity)}'
    return line


def triton_interpreted():
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET`` set in the environment; tests):
    the one flag that both the ops' choice of path (:func:`triton_device_types`) and the Triton modules'
    device check (:func:`visattn_mm.ops.triton.host.check_device`) read.

    Read per call, so that tests can flip it. Triton itself reads the variable when it defines each
    ``@triton.jit`` function, i.e. when an op's Triton module (``visattn_mm.ops.<op>.triton``) is imported: it
    must be set before that import, and changing it afterwards changes where the ops send tensors, not what the
    kernels are.
    """
    return os.environ.get('TRITON_INTERPRET', '').lower() in ('1', 'true', 'on', 'yes')


def triton_device_types():
    """Device types whose tensors the Triton kernels take: CUDA, and the CPU under Triton's
    interpreter (:func:`triton_interpreted`; tests)."""
    return ('cuda', 'cpu') if triton_interpreted() else ('cuda',)


@contextlib.contextmanager
def dispatch_as(device_type):
    """Inside, the ops choose their path (and the Triton ops accept tensors) as if their tensors
    were on ``device_type``: the step-cost tracer (:mod:`visattn_mm.analysis.step_cost`) runs
    fake CPU tensors that stand for CUDA ones, so that they take the path a GPU would.

    Args:
        device_type (str): E.g. ``'cuda'``.
    """
    previous = STATE.dispatch_device_type
    STATE.dispatch_device_type = device_type
    try:
        yield
    finally:
        STATE.dispatch_device_type = previous


def dispatch_device_type(device_type):
    """The device type an op on tensors of ``device_type`` chooses its path for (see :func:`dispatch_as`)."""
    return STATE.dispatch_device_type or device_type


def chosen_path(device_type, bias_needs_grad=False, impl='auto', op=None, dtype=None, head_dim=None):
    """The path ('fast', 'math' or 'triton') an op asked to use ``impl`` takes.

    Args:
        device_type (str): The inputs' device type ('cpu', 'cuda', ...).
        bias_needs_grad (bool): Whether a logit bias of the op needs a
            gradient. PyTorch's CPU fused kernel cannot return a bias
            gradient, so PyTorch runs its math kernel on the fused path's
            padded tensors instead: no faster than the explicit path and more
            saved for backward; 'auto' keeps the explicit path then.
        impl (str): The op's (its model's) choice, see :func:`resolve_impl`.
        op (str, optional): The op's name (:data:`visattn_mm.ops.specs.OPS`); 'triton' is taken by an op
            on :func:`triton_device_types`, elsewhere (and by None, a part of an op) it means 'auto'.
        dtype (torch.dtype, optional): The query's dtype, and
        head_dim (int, optional): its head dim: on CUDA, 'auto' follows the row of
            :mod:`visattn_mm.ops.cuda_defaults` they select (None: the op's bf16 row).
    """
    device_type = dispatch_device_type(device_type)
    choice = resolve_impl(impl)
    if choice == 'triton':
        if op in OPS and device_type in triton_device_types():
            return 'triton'
        choice = 'auto'
    if choice != 'auto':
        return choice
    if device_type == 'cuda':
        row = cuda_default(op, dtype, head_dim)
        if row is None or row.path != 'triton':
            return 'fast'
        if bias_needs_grad and torch.are_deterministic_algorithms_enabled():
            # The kernels then sum the bias gradient in a kernel of their own (ops.triton.host.bias_grad_parts),
            # which no GPU row has measured: 'auto' takes only what a GPU has passed and timed.
            STATE.warn_once(
                ('deterministic_bias_grad', op),
                f"attn_impl 'auto' runs {op} attention with torch ops ('fast'), not Triton kernels, while "
                'torch.use_deterministic_algorithms is on and a bias trains: their deterministic bias gradient has '
                "not been measured on a GPU yet (attn_impl='triton' runs it)",
            )
            return 'fast'
        return 'triton'
    fused = device_type in FUSED_DEVICES and not (device_type == 'cpu' and bias_needs_grad)
    return 'fast' if fused else 'math'


def attention_path(op, q, *biases, impl='auto', window=None, dropout_p=0.0):
    """The one path decision of an op call: 'triton', 'fast' or 'math' (see :func:`chosen_path`), 'triton'
    only where :func:`can_run_triton`.

    Args:
        op (str | None): The op's name (e.g. 'sliding_chunk'); None for a part of an op without Triton kernels of
            its own (Pale's row attention), which runs 'fast' or 'math'.
        q (torch.Tensor): The op's queries ``(..., N, head_dim)``: their device, dtype and head dim decide 'auto'.
        *biases (torch.Tensor | None): The op's logit biases (whether one needs a gradient decides 'auto' on the CPU).
        impl (str): The op's (its model's) choice, see :func:`resolve_impl`.
        window (int, optional): The op's chunk (segment) size, where it has one.
        dropout_p (float): The op's attention dropout.

    Raises:
        ValueError: Where 'triton' was asked for (explicitly or process-wide) and cannot run the call.
    """
    bias_grad = torch.is_grad_enabled() and any(b is not None and b.requires_grad for b in biases)
    path = chosen_path(q.device.type, bias_grad, impl, op=op, dtype=q.dtype, head_dim=q.shape[-1])
    if path != 'triton':
        return path
    asked = resolve_impl(impl) == 'triton'
    return path if can_run_triton(op, q, window=window, dropout_p=dropout_p, raise_error=asked) else 'fast'


def triton_limit(op, q, window=None, dropout_p=0.0):
    """What keeps the Triton kernels of ``op`` from running a call, in words (its spec's
    :class:`~visattn_mm.ops.specs.TritonLimits`); None where nothing does. The kernels' public functions
    refuse the same (see :func:`can_run_triton`)."""
    return op_spec(op).triton_limits.reason(q, window, dropout_p, triton_interpreted())


def can_run_triton(op, q, *, window=None, dropout_p=0.0, raise_error=False):
    """Whether the Triton kernels of ``op`` can run this call (NATTEN's ``can_run_*`` predicates): where
    they cannot, raises naming the reason and the fix if ``raise_error``, else warns once per reason
    (the path 'auto' then runs instead is the fused torch one).

    Args:
        op (str): A name in :data:`visattn_mm.ops.specs.OPS`.
        q (torch.Tensor): The op's queries ``(..., N, head_dim)``.
        window (int, optional): The op's chunk (segment) size, where it has one.
        dropout_p (float): The op's attention dropout.
        raise_error (bool): Raise instead of warning.

    Raises:
        ValueError: Where the kernels cannot run the call and ``raise_error``.
    """
    reason = triton_limit(op, q, window=window, dropout_p=dropout_p)
    if reason is None:
        return True
    if raise_error:
        raise ValueError(
            f"impl 'triton' cannot run this {op} attention call: {reason}; use {op_spec(op).torch_paths} for it"
        )
    STATE.warn_once(
        ('triton_skip', op, reason),
        f"attn_impl 'auto' runs {op} attention with torch ops here, not Triton kernels: {reason}",
    )
    return False
