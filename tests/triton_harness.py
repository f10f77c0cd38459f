"""Shared by the tests of the Triton kernels (``impl='triton'``): the interpreter subprocess and the checks.

Triton decides whether a ``@triton.jit`` kernel is compiled or interpreted when
the kernel is defined, from ``TRITON_INTERPRET``. A test file's CPU comparisons
therefore run in one subprocess that starts with ``TRITON_INTERPRET=1`` and runs
the file as a script (:func:`interpreter_results`, :func:`main`); the pytest
process keeps the kernels compiled for the compile check and the GPU tests.
Every comparison counts the launches of each kernel to prove which path ran, and
every load, store and atomic the interpreter runs must address a tensor argument's
storage (:func:`bounds_checked`).
"""

import collections
import contextlib
import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

from paths import ROOT
from visattn_mm.analysis.benchmarking import deterministic_algorithms
from visattn_mm.ops import impl

PACKAGE = 'visattn_mm.ops.triton'
HOST = 'visattn_mm.ops.triton.host'


# Relative error ||x - ref|| / ||ref|| of the output and of each gradient allowed in fp32 / 16 bits
# (:func:`low_precision_errors`). fp32 products are full fp32 ('highest' matmul precision); 16-bit runs
# round the inputs, the probabilities and the logit gradients. Measured in the interpreter (sliding
# chunk, fp16, 8x10 map, w 3): at most 1.4e-3 (the l2g gradient, a sum with cancellation); bf16 has 3
# mantissa bits fewer. A wrong mask or layout is off by order 1.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-2}
#: The dtypes of every op's CUDA kernel tests: those of the defaults table's rows (visattn_mm/ops/cuda_defaults.py),
#: whose rule wants the op's own kernel tests passed in the row's dtype.
CUDA_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA_DTYPE_IDS = ['fp32', 'bf16', 'fp16']


def interpreter_results(test_file):
    """Runs ``test_file`` as a script with Triton's interpreter on: the ``{name: result}`` it prints."""
    pytest.importorskip('triton')
    env = dict(
        os.environ,
        TRITON_INTERPRET='1',
        # What pytest's pythonpath (setup.cfg) gives the test process, and the package of this tree.
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / 'tests'), os.environ.get('PYTHONPATH', '')]),
    )
    proc = subprocess.run(
        [sys.executable, str(test_file)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Triton before 3.7 makes each scalar argument a 1-element array in its interpreter and a loop bound an
# int through ``int(array)``, which NumPy 2.5 refuses; Triton 3.7 squeezes the array first. Only the
# interpreter is concerned: the compiled kernels never see NumPy. (Found by the rehearsal with the GPU
# host's Triton 3.6 and NumPy 2.5, tools/gpu_session.sh rehearse.)
INTERPRETER_DEFECT = 'only 0-dimensional arrays can be converted to Python scalars'


def assert_no_error(result):
    """A result of the interpreter subprocess holds no error; skips where the error is the interpreter
    defect of Triton < 3.7 with NumPy >= 2.5 (:data:`INTERPRETER_DEFECT`), which says nothing of the kernels."""
    error = result.get('error')
    if error and INTERPRETER_DEFECT in error:
        import numpy
        import triton

        pytest.skip(
            f"Triton {triton.__version__}'s interpreter cannot run this kernel with NumPy {numpy.__version__} "
            f"({INTERPRETER_DEFECT!r}; fixed in Triton 3.7): the compiled kernels are checked on the GPU"
        )
    assert error is None, error


def interpreted_fixture():
    """The module-scoped fixture ``interpreted`` of a test file (``interpreted = interpreted_fixture()``):
    the results of its comparisons, run in the interpreter subprocess (:func:`interpreter_results`)."""

    @pytest.fixture(scope='module', name='interpreted')
    def fixture(request):
        return interpreter_results(request.module.__file__)

    return fixture


def main(case_inputs, cases, **comparisons):
    """The script side of :func:`interpreter_results`: every case of ``cases`` (``case_inputs(name, dtype)``
    gives its ``(leaves, op)``, compared by :func:`compare_paths` in float64) and the other ``comparisons``,
    each caught separately, as one JSON line ``{name: result or {'error': text}}`` on stdout; under
    ``'interpreter changes'``, what :func:`~visattn_mm.ops.triton.interpreter.speed_up_the_interpreter` changed."""
    from visattn_mm.ops.triton.interpreter import speed_up_the_interpreter

    results = {'interpreter changes': speed_up_the_interpreter()}
    comparisons = {
        **{name: lambda name=name: compare_paths(*case_inputs(name, torch.float64)) for name in cases},
        **comparisons,
    }
    for name, compare in comparisons.items():
        try:
            with bounds_checked():
                results[name] = compare()
        except Exception:  # reported per case by the parent
            results[name] = dict(error=traceback.format_exc())
    print(json.dumps(results))


class OutOfBounds(AssertionError):
    """A kernel addressed memory outside every tensor argument (:func:`bounds_checked`)."""


@contextlib.contextmanager
def bounds_checked():
    """Makes Triton's interpreter check every address a kernel loads, stores or updates atomically
    (where its mask lets it) against the storages of the launch's tensor arguments, raising
    :class:`OutOfBounds` on the first access outside them. On the GPU such an access is an illegal
    address at best and a silent read of a neighbour's memory at worst; the interpreter would read
    host memory there without a word."""
    import numpy as np
    import triton
    from triton.runtime import interpreter

    from visattn_mm.ops.triton import host

    triton_dir = os.path.dirname(triton.__file__)

    spans = []  # (first byte, end) of each tensor argument's storage in the running launch, sorted
    kernel = ['']  # the running launch's kernel
    executor, builder = interpreter.GridExecutor, interpreter.InterpreterBuilder
    saved = {
        (owner, name): getattr(owner, name)
        for owner, name in [
            (executor, '_init_args_hst'),
            (builder, 'create_masked_load'),
            (builder, 'create_masked_store'),
            (builder, 'create_atomic_rmw'),
            (builder, 'create_atomic_cas'),
        ]
    }

    def init_args(self, args, kwargs):
        host_args, host_kwargs = saved[executor, '_init_args_hst'](self, args, kwargs)
        storages = [
            a.untyped_storage()
            for a in host.tensor_args((*host_args, *host_kwargs.values()))
            if hasattr(a, 'untyped_storage')
        ]
        spans[:] = sorted((s.data_ptr(), s.data_ptr() + s.nbytes()) for s in storages)
        kernel[:] = [self.fn.__name__]
        return host_args, host_kwargs

    def check(kind, pointers, mask):
        addresses = pointers.data.astype(np.uint64)
        if mask is not None:
            addresses = addresses[np.broadcast_to(mask.data.astype(bool), addresses.shape)]
        if not addresses.size:
            return
        item = np.uint64(np.dtype(interpreter._get_np_dtype(pointers.get_element_ty())).itemsize)
        starts = np.array([start for start, _ in spans], dtype=np.uint64)
        ends = np.array([end for _, end in spans], dtype=np.uint64)
        span = np.searchsorted(starts, addresses, side='right') - 1
        inside = (span >= 0) & (addresses + item <= ends[np.maximum(span, 0)])
        if not inside.all():
            first = int(addresses[~inside][0])
            nearest = min(spans, key=lambda span: min(abs(first - span[0]), abs(first - span[1])))
            # The interpreter runs the kernel's Python: the innermost frame neither Triton's nor this
            # file's is the access.
            frame = next(
                f for f in reversed(traceback.extract_stack()) if not f.filename.startswith((triton_dir, __file__))
            )
            raise OutOfBounds(
                f'{kernel[0]}: a {kind} of {int((~inside).sum())} of {addresses.size} elements addressed memory '
                f'outside every tensor argument; the first at byte {first - nearest[0]} of the nearest argument '
                f'storage, {nearest[1] - nearest[0]} bytes long ({frame.filename}:{frame.lineno}: {frame.line})'
            )

    def load(self, pointers, mask, *rest):
        check('load', pointers, mask)
        return saved[builder, 'create_masked_load'](self, pointers, mask, *rest)

    def store(self, pointers, value, mask, *rest):
        check('store', pointers, mask)
        return saved[builder, 'create_masked_store'](self, pointers, value, mask, *rest)

    def atomic_rmw(self, op, pointers, value, mask, *rest):
        check('atomic update', pointers, mask)
        return saved[builder, 'create_atomic_rmw'](self, op, pointers, value, mask, *rest)

    def atomic_cas(self, pointers, *rest):
        check('atomic compare-and-swap', pointers, None)
        return saved[builder, 'create_atomic_cas'](self, pointers, *rest)

    executor._init_args_hst = init_args
    builder.create_masked_load, builder.create_masked_store = load, store
    builder.create_atomic_rmw, builder.create_atomic_cas = atomic_rmw, atomic_cas
    try:
        yield
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)


def stray_load():
    """A kernel that loads one element past the end of its input: :func:`bounds_checked` must refuse it
    (the interpreter itself reads on)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_shifted(source, target, SIZE: tl.constexpr):
        offsets = tl.arange(0, SIZE)
        tl.store(target + offsets, tl.load(source + offsets + 1))

    source = torch.arange(8.0)
    target = torch.empty_like(source)
    _copy_shifted[(1,)](source, target, SIZE=8)
    return dict(copied=target.tolist())


def launches_since(before):
    """Launches per kernel name since the ``before`` snapshot of the counter."""
    from visattn_mm.ops.process_state import STATE

    return {
        name: count - before.get(name, 0)
        for name, count in STATE.kernel_launches.items()
        if count != before.get(name, 0)
    }


def launch_snapshot():
    from visattn_mm.ops.process_state import STATE

    return dict(STATE.kernel_launches)


def mismatches(actual, expected, rtol, atol):
    """``'label: error'`` for each tensor of ``actual`` that differs from ``expected`` (dicts by label)."""
    found = []
    for label, tensor in actual.items():
        try:
            torch.testing.assert_close(tensor, expected[label], rtol=rtol, atol=atol)
        except AssertionError as error:
            found.append(f'{label}: {error}')
    return found


def forward_backward(leaves, op, impl):
    """Output and leaf gradients of a fixed weighted sum of ``op(impl)``, by label; kernel launches made."""
    before = launch_snapshot()
    out = op(impl)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out * weights.to(out)).sum(), leaves)
    tensors = dict(output=out, **{f'grad {i} {tuple(g.shape)}': g for i, g in enumerate(grads)})
    return tensors, launches_since(before)


def compare_paths(leaves, op):
    """Runs ``op`` on the math and the Triton path in float64 (interpreter subprocess).

    Returns:
        dict: the kernel launches of each path and the output / gradient mismatches.
    """
    assert impl.triton_interpreted(), 'the kernels must run in the interpreter here'
    expected, math_launches = forward_backward(leaves, op, 'math')
    actual, launches = forward_backward(leaves, op, 'triton')
    return dict(
        math_launches=math_launches, launches=launches, mismatches=mismatches(actual, expected, rtol=1e-10, atol=1e-10)
    )


def compare_deterministic(case_inputs, names):
    """:func:`compare_paths` of the cases ``names`` (in float64) under :func:`deterministic_algorithms`
    (interpreter subprocess)."""
    with deterministic_algorithms():
        return {name: compare_paths(*case_inputs(name, torch.float64)) for name in names}


def assert_cuda_deterministic(errors_on, dtype, launches, *args):
    """:func:`assert_cuda_within_tolerance` under :func:`deterministic_algorithms`, and a second run's
    errors equal to the first's to the bit: the gradients did not change between runs (atomics would
    let their last bits vary)."""
    with deterministic_algorithms():
        assert_cuda_within_tolerance(errors_on, dtype, launches, *args)
        first, second = (errors_on('cuda', dtype, *args)[0] for _ in range(2))
    assert first == second


def assert_kernels_matched(result, launches):
    """A :func:`compare_paths` or :func:`compare_backbone` result: the math path launched no kernel, the
    Triton path ``launches`` (``{kernel name: count}``), and every tensor agreed."""
    assert_no_error(result)
    assert result['math_launches'] == {}
    assert result['launches'] == launches
    assert not result['mismatches'], '\n'.join(result['mismatches'])


def compare_backbone(cls, reference=(('attn_impl', 'math'),), candidate=(('attn_impl', 'triton'),), evaluation=False):
    """A tiny ``cls`` backbone built with the ``candidate`` arguments against the same weights with the ``reference``
    ones (default: attn_impl 'triton' against 'math'; interpreter subprocess), in evaluation mode: outputs and
    parameter gradients, the outputs without gradients too where ``evaluation``, and the kernel launches of each
    (``math_launches``: the reference's; ``evaluation_launches``: the candidate's without gradients)."""
    from helpers import build_tiny

    image = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    results = {}
    for side, arguments in (('reference', reference), ('candidate', candidate)):
        torch.manual_seed(0)
        model = build_tiny(cls, **dict(arguments), drop_path_rate=0.0).double().eval()
        before = launch_snapshot()
        outs = model(image)
        grads = torch.autograd.grad(sum(o.pow(2).mean() for o in outs), list(model.parameters()))
        tensors = {f'output {i}': o for i, o in enumerate(outs)}
        tensors.update((name, g) for (name, _), g in zip(model.named_parameters(), grads))
        launches = {'launches': launches_since(before)}
        if evaluation:
            before = launch_snapshot()
            with torch.no_grad():
                tensors.update((f'evaluation output {i}', o) for i, o in enumerate(model(image)))
            launches['evaluation_launches'] = launches_since(before)
        results[side] = tensors, launches
    (reference_tensors, reference_launches), (tensors, launches) = results['reference'], results['candidate']
    return dict(
        math_launches=reference_launches['launches'],
        **launches,
        mismatches=mismatches(tensors, reference_tensors, rtol=1e-9, atol=1e-10),
    )


class StandInDriver:
    """Triton's active driver where there is no GPU: device 0, stream 0, an sm_90 target. Enough for
    ``JITFunction.warmup`` to bind, specialise and compile a launch's arguments as a launch on a Hopper GPU
    does, stopping before the launch itself."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget('cuda', 90, 32)


def compiling_launches(monkeypatch, tmp_path):
    """Makes the kernel launches compile the kernel for sm_90 instead of running it, through Triton's own
    launch path (``kernel.warmup`` under :class:`StandInDriver`: the argument binding and specialisation a
    GPU launch does, then Triton's bundled compiler and ptxas), and lets CPU tensors through the device
    check.

    Returns:
        list: ``(kernel name, cubin bytes)`` per launch, filled as they happen.
    """
    host = pytest.importorskip(HOST)
    if impl.triton_interpreted():
        pytest.skip('TRITON_INTERPRET is on in this process: the kernels are not compilable objects')
    from triton.runtime.driver import driver

    compiled = []

    def compile_instead(kernel, grid, settings, *args, **constexprs):
        # The kernel's per-device binders made under the stand-in are dropped after the test.
        monkeypatch.setattr(kernel, 'device_caches', collections.defaultdict(kernel.create_binder))
        settings = host.tuned_settings(kernel, settings, args, constexprs)
        binary = kernel.warmup(*args, grid=grid, **settings, **constexprs)
        compiled.append((kernel.fn.__name__, len(binary.asm['cubin'])))

    monkeypatch.setenv('TRITON_CACHE_DIR', str(tmp_path))  # compile for real, not from a cache
    monkeypatch.setattr(driver, '_active', StandInDriver())
    monkeypatch.setattr(host, 'launch', compile_instead)
    set_interpreted(monkeypatch, True)  # CPU tensors pass the device check
    return compiled


def set_interpreted(monkeypatch, on):
    """Makes the interpreter flag (:func:`visattn_mm.ops.impl.triton_interpreted`) ``on`` for the test: the
    Triton ops then take CPU tensors (on) or refuse them (off), whatever the kernels are."""
    monkeypatch.setattr(impl, 'triton_interpreted', lambda: on)


def skip_unless_compiled():
    """Skips a GPU test in a process where the kernels are interpreted."""
    pytest.importorskip(HOST)
    if impl.triton_interpreted():
        pytest.skip('TRITON_INTERPRET is on in this process')


def low_precision_errors(op, tokens, biases, device, dtype):
    """Relative errors ``||x - ref|| / ||ref||`` of the Triton path on ``device`` with tokens in ``dtype``
    and fp32 biases (what the backbones pass under autocast) against the math path in float64 on the
    same rounded values.

    Args:
        op (callable): ``op(*tokens, *biases, impl=...)``, the op's output.
        tokens (list[Tensor]): float64 inputs that the Triton run gets in ``dtype``.
        biases (list[Tensor]): float64 inputs that the Triton run gets in fp32.

    Returns:
        tuple: The errors of the output and of each input's gradient, in order, and the kernel
        launches of the Triton run.
    """
    tokens = [t.to(dtype).double() for t in tokens]

    def run(inputs, impl):
        inputs = [t.detach().requires_grad_() for t in inputs]
        before = launch_snapshot()
        out = op(*inputs, impl=impl)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        grads = torch.autograd.grad((out.double() * weights.to(out.device)).sum(), inputs)
        return [t.double().cpu() for t in (out, *grads)], sum(launches_since(before).values())

    reference, _ = run(tokens + biases, 'math')
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision('highest')
    try:
        results, launches = run(
            [t.to(device, dtype) for t in tokens] + [b.to(device, torch.float32) for b in biases], 'triton'
        )
    finally:
        torch.set_float32_matmul_precision(previous)
    return [((r - ref).norm() / ref.norm()).item() for r, ref in zip(results, reference)], launches


def assert_cuda_within_tolerance(errors_on, dtype, launches, *args):
    """The body of a CUDA test: ``errors_on('cuda', dtype, *args)`` (``({label: error}, kernel launches)``,
    see :func:`low_precision_errors`) made ``launches`` launches, every error within the dtype's
    tolerance. Skips where the kernels are interpreted."""
    skip_unless_compiled()
    errors, made = errors_on('cuda', dtype, *args)
    assert made == launches
    assert max(errors.values()) < TOLERANCES[dtype], errors


def assert_fp16_within_tolerance(result, launches=3):
    """An interpreter fp16 result (``dict(launches=..., errors={label: error})``) within the tolerance."""
    assert_no_error(result)
    assert result['launches'] == launches
    assert max(result['errors'].values()) < TOLERANCES[torch.float16], result['errors']
