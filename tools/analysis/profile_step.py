"""Where a training step's GPU time goes: each backbone's kernels by class, its busy fraction, its floor.

For Swin-T and each family's backbone beside it (``--models``, named and built as ``benchmark.py`` and
``step_cost_report.py`` do: Swin-T is timm's, as in the GPU measurements and the floor), one training step as
the benchmark runs it (forward + backward, loss = sum of the output maps' means, gradients freed) on
``--batches`` images of ``--size`` under ``--dtype`` autocast, on the attention path ``--impl``
(default ``'auto'``: what a user gets). Per model and batch:
``--warmup`` untimed steps, ``--steps`` timed ones (wall time per step: their median; peak memory: as
``benchmark.py`` measures it), then ``--profiled-steps`` steps under ``torch.profiler``. The cases run
batch by batch, Swin-T first.

Reported per model and batch:

* every kernel the profiled steps ran, summed by class (:func:`kernel_class`): our Triton kernels one by
  one (``op:kernel``, e.g. ``sliding_chunk:_sliding_chunk_backward_keys``), then ``sdpa`` (torch's fused
  attention), ``gemm``, ``conv``, ``norm``, ``softmax``, ``cast``, ``copy``, ``fill``, ``reduction``,
  ``elementwise``, ``inductor`` (torch.compile's generated kernels) and ``other``; time and launches per
  step, share of the kernel time;
* kernels launched per step, wall time per step, and the GPU's busy fraction: summed kernel time over
  wall time (below 1 where the GPU waits for the host);
* the floor: the step's bytes at full memory bandwidth plus its attention FLOPs at peak
  (``--bandwidth-tbs``, ``--peak-tflops``; H200 figures by default), both counted by the step-cost
  tracer (``visattn_mm.analysis.step_cost``) on fake tensors with CUDA's dispatch emulated, i.e. the
  same program; ``--no-floor`` leaves it out.

On the CPU (``--device cpu``) the same runs with CPU op events in place of kernels: an op's own time
(its time less that of the ops it called) is classed by its name, a ``copy_`` called by ``_to_copy``
as a cast, and the ops that call no other op count as launched. That run is for smoke tests and
rehearsals; its shares say nothing about a GPU.

Writes ``<out-dir>/profile_step.csv`` (one row per model, batch and class, plus an ``all`` row per case;
rewritten after every case) and ``profile_step.md`` (the tables it prints). Interrupted (Ctrl-C,
``timeout -s INT``), it reports the cases measured until then and exits with status 1.

Example (the GPU session's ``profile`` stage runs it so)::

    python tools/analysis/profile_step.py --device cuda --batches 8,2 --size 800x1333
"""

from __future__ import annotations

import argparse
import ast
import collections
import os.path as osp
import re

import torch

import visattn_mm
from visattn_mm.analysis import benchmarking as bench
from visattn_mm.analysis.benchmark_backbones import MODEL_ZOO, build_backbone, case_function
from visattn_mm.analysis.step_cost import OP_CLASSES, trace_step
from visattn_mm.models import FAMILIES
from visattn_mm.ops.impl import ATTENTION_IMPLS, attention_impl
from visattn_mm.ops.specs import OP_NAMES

DEFAULT_MODELS = ('swin-t',) + tuple(family.compared_model for family in FAMILIES)
OPS_FOLDER = osp.join(osp.dirname(visattn_mm.__file__), 'ops')
# The classes of kernels that are not ours, in the order the tables show them.
KERNEL_CLASSES = (
    'sdpa',
    'gemm',
    'conv',
    'norm',
    'softmax',
    'cast',
    'copy',
    'fill',
    'reduction',
    'elementwise',
    'inductor',
    'other',
)
ALL = 'all'  # the class of a case's totals row
# Kernel (and CPU op) names by class, tried in this order: the first that matches wins, so the specific
# come before the general (flash attention's 'convert' kernels before conv, cuDNN's batch norm before
# conv, cuDNN's implicit-GEMM convolutions before gemm, casting copies before copies).
KERNEL_PATTERNS = (
    ('inductor', r'^triton_(poi|red|per|tem|for)_'),
    ('sdpa', r'fmha|flash_fwd|flash_bwd|pytorch_flash|AttentionKernel|AttentionBackwardKernel|sdpa|scaled_dot_product'),
    (
        'norm',
        r'(?i)layer_?norm|group_?norm|batch_?norm|bn_fw|bn_bw|RowwiseMoments|GammaBeta|Compute\w*FusedParams'
        r'|ComputeInternalGradients',
    ),
    ('conv', r'(?i)conv(?!ert)|fprop|dgrad|wgrad|depthwise|nchwToNhwc|nhwcToNchw|convertTensor|cudnn'),
    ('gemm', r'(?i)gemm|gemv|nvjet|cutlass|xmma|cublas|splitKreduce|^aten::(linear|matmul)$'),
    ('softmax', r'(?i)softmax'),
    ('cast', r'(float16|bfloat16|float8)\w*_copy_kernel|CastCopyFunctor|copy_kernel.*WithCast|^aten::_to_copy$'),
    ('copy', r'(?i)copy|Memcpy|CatArray|index_elementwise|indexSelect|index_?put|gather|scatter|roll_cuda|_pad'),
    ('fill', r'FillFunctor|Memset'),
    ('reduction', r'reduce_kernel|ReduceOp|cub::|DeviceReduce|DeviceScan|scan_kernel'),
    ('elementwise', r'elementwise_kernel|distribution_|fused_dropout'),
)
_PATTERNS = tuple((name, re.compile(pattern)) for name, pattern in KERNEL_PATTERNS)
# ATen ops by the step-cost tracer's classes, for CPU op names that no pattern above matches.
_TRACER_CLASSES = dict(
    layout='copy', matmul='gemm', attention='sdpa', norm='norm', softmax='softmax', reduction='reduction', fill='fill'
)
_ATEN_CLASSES = {f'aten::{op}': _TRACER_CLASSES[tracer_class] for tracer_class, ops in OP_CLASSES.items() for op in ops}
CSV_COLUMNS = (
    'model',
    'impl',
    'device',
    'dtype',
    'batch',
    'height',
    'width',
    'kernel_class',
    'launches_per_step',
    'time_ms_per_step',
    'share',
    'wall_ms',
    'kernel_ms',
    'busy',
    'floor_ms',
    'wall_vs_floor',
    'peak_mem_mib',
    'status',
)


def own_kernels(folder=OPS_FOLDER):
    """Our Triton kernels and custom ops by name, each with the op it belongs to.

    Read from the source of each op's Triton module in ``folder`` (``ops/<op>/triton.py`` for the ops of
    ``visattn_mm.ops.specs.OP_NAMES``), not imported, so that no Triton is needed: every ``@triton.jit`` function (the
    kernels, and their helpers, which are inlined and never show in a profile) and the custom ops
    ``host.define_op`` registers (``visattn_mm::<name>`` and ``visattn_mm::<name>_backward``, the
    names the CPU profiler shows).

    Args:
        folder (str): The folder of the op packages. Default: the package's ``ops``.

    Returns:
        dict[str, str]: ``{kernel or op name: op}``, e.g. ``{'_pale_forward': 'pale'}``.
    """
    names = {}
    for op in OP_NAMES:
        with open(osp.join(folder, op, 'triton.py')) as source:
            tree = ast.parse(source.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                if any(ast.unparse(d).split('(')[0] == 'triton.jit' for d in node.decorator_list):
                    names[node.name] = op
            elif isinstance(node, ast.Call) and ast.unparse(node.func).split('.')[-1] == 'define_op':
                registered = f'visattn_mm::{node.args[0].value}'
                names[registered] = names[f'{registered}_backward'] = op
    return names


def kernel_class(name, own):
    """The class of a CUDA kernel (or CPU op) named ``name``.

    Args:
        name (str): The kernel's name as the profiler reports it (demangled), or a CPU op's
            (``aten::addmm``).
        own (dict[str, str]): Our kernels and custom ops, :func:`own_kernels`.

    Returns:
        str: ``'<op>:<name>'`` for ours (``'pale:_pale_forward'``), else one of :data:`KERNEL_CLASSES`:
        the first of :data:`KERNEL_PATTERNS` that matches; an ATen op that none matches by the step-cost
        tracer's class of it (``elementwise`` where it has none); any other kernel ``other``.
    """
    if name in own:
        return f'{own[name]}:{name}'
    for kind, pattern in _PATTERNS:
        if pattern.search(name):
            return kind
    if name.startswith('aten::'):
        return _ATEN_CLASSES.get(name, 'elementwise')
    return 'other'


def is_own(kind):
    """Whether a class of :func:`kernel_class` is one of our kernels (``'<op>:<name>'``)."""
    return ':' in kind


def kernel_samples(events):
    """``(name, microseconds, launched)`` of each kernel, copy and fill the GPU ran.

    Args:
        events (Iterable): The profiler's events (``torch.profiler.profile.events()``).
    """
    gpu = [event for event in events if event.device_type == torch.autograd.DeviceType.CUDA]
    return [(event.name, event.time_range.elapsed_us(), True) for event in gpu]


def cpu_op_samples(events):
    """``(name, own microseconds, launched)`` of each CPU op: a ``copy_`` that ``_to_copy`` called named as
    its caller (a cast), and launched where it called no other op.

    Args:
        events (Iterable): The profiler's events (``torch.profiler.profile.events()``).
    """
    samples = []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.is_user_annotation:
            continue
        caller = event.cpu_parent.name if event.cpu_parent is not None else None
        name = caller if event.name == 'aten::copy_' and caller == 'aten::_to_copy' else event.name
        samples.append((name, event.self_cpu_time_total, not event.cpu_children))
    return samples


def summarize(samples, own, steps):
    """Per class, launches and milliseconds per step.

    Args:
        samples (Iterable[tuple[str, float, bool]]): ``(name, microseconds, launched)`` over ``steps`` steps.
        own (dict[str, str]): :func:`own_kernels`.
        steps (int): How many steps the samples cover.

    Returns:
        dict[str, dict]: ``{class: {'launches_per_step', 'time_ms_per_step'}}``, our kernels first, then
        :data:`KERNEL_CLASSES` in order (classes without samples left out).
    """
    launches, micros = collections.Counter(), collections.Counter()
    for name, elapsed, launched in samples:
        kind = kernel_class(name, own)
        launches[kind] += launched
        micros[kind] += elapsed
    order = sorted(k for k in micros if is_own(k)) + [k for k in KERNEL_CLASSES if k in micros]
    return {k: dict(launches_per_step=launches[k] / steps, time_ms_per_step=micros[k] / 1e3 / steps) for k in order}


def profile_steps(fn, device, steps):
    """Runs ``fn`` ``steps`` times under ``torch.profiler``.

    Args:
        fn (callable): One training step.
        device (torch.device): Where it runs.
        steps (int): How many steps to profile.

    Returns:
        list[tuple[str, float, bool]]: ``(name, microseconds, launched)`` samples: the GPU's kernels on
        CUDA (:func:`kernel_samples`), else the CPU's ops (:func:`cpu_op_samples`).
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            fn()
        bench.synchronize(device)
    events = profiler.events()
    return kernel_samples(events) if device.type == 'cuda' else cpu_op_samples(events)


def step_floor(name, impl, batch, size, dtype, bandwidth_tbs, peak_tflops):
    """The floor of one step in milliseconds: its bytes moved at ``bandwidth_tbs`` TB/s plus its attention
    FLOPs at ``peak_tflops`` TFLOP/s, as the step-cost tracer counts them for CUDA (on copies of the model
    built here: the tracer makes their parameters fake). The FLOP count is that of the step on ``'fast'``,
    whose attention is torch's SDPA: our Triton kernels are custom ops with no FLOP formula, and VVT's
    linear attention counts as matrix products (none).

    Args:
        name (str): The model, a key of ``visattn_mm.analysis.benchmark_backbones.MODEL_ZOO``.
        impl (str): Its attention path (``bench.NO_IMPL`` for the baselines).
        batch (int): Images per step.
        size (tuple[int, int]): Their height and width.
        dtype (str): 'fp32', or 'bf16' / 'fp16' autocast.
        bandwidth_tbs (float): Memory bandwidth, TB/s.
        peak_tflops (float): FLOP rate of the attention, TFLOP/s.
    """

    def traced(path):
        model = build_backbone(name).train()
        with attention_impl(path):
            return trace_step(model, (batch, 3, *size), dtype=dtype, mode='fwd+bwd', device_type='cuda')

    cost = traced('auto' if impl == bench.NO_IMPL else impl)
    attention = (cost if impl in (bench.NO_IMPL, 'fast') else traced('fast')).by_class().get('attention')
    attention_flops = attention.flops if attention else 0
    return (cost.total().bytes_moved / (bandwidth_tbs * 1e12) + attention_flops / (peak_tflops * 1e12)) * 1e3


def case_fields(name, batch, device, args):
    """The fields that name a case in the CSV (model, path, device, dtype, batch, size).

    Args:
        name (str): The model's name (``visattn_mm.analysis.benchmark_backbones.MODEL_ZOO``).
        batch (int): Images per step.
        device (torch.device): Where it runs.
        args (argparse.Namespace): The run's options (:func:`parse_args`).
    """
    impl = args.impl if MODEL_ZOO[name][1] else bench.NO_IMPL
    return dict(
        model=name,
        impl=impl,
        device=device.type,
        dtype=args.dtype,
        batch=batch,
        height=args.size[0],
        width=args.size[1],
    )


def floor_case(name, batch, device, args):
    """The ``all`` row of a case with its floor alone (``--floor-only``: nothing runs).

    Args:
        name (str): The model's name (``visattn_mm.analysis.benchmark_backbones.MODEL_ZOO``).
        batch (int): Images per step.
        device (torch.device): The device named in the row.
        args (argparse.Namespace): The run's options (:func:`parse_args`).
    """
    case = case_fields(name, batch, device, args)
    floor_ms = step_floor(name, case['impl'], batch, args.size, args.dtype, args.bandwidth_tbs, args.peak_tflops)
    return dict(case, kernel_class=ALL, floor_ms=floor_ms, status='floor only')


def profile_case(name, model, batch, device, meter, args, own):
    """Measures and profiles one model at one batch.

    Args:
        name (str): The model's name (``visattn_mm.analysis.benchmark_backbones.MODEL_ZOO``).
        model (nn.Module): The model, on ``device``.
        batch (int): Images per step.
        device (torch.device): Where it runs.
        meter: The peak-memory meter (``visattn_mm.analysis.benchmarking.memory_meter``).
        args (argparse.Namespace): The run's options (:func:`parse_args`).
        own (dict[str, str]): :func:`own_kernels`.

    Returns:
        list[dict]: The case's CSV rows, its ``all`` row first (alone, with the reason, where it failed).
    """
    case = case_fields(name, batch, device, args)
    impl = case['impl']
    images = torch.randn(batch, 3, *args.size, device=device)
    fn = case_function(model, images, 'fwd+bwd', device, args.dtype)
    timing = dict(case)
    bench.measure_case(timing, fn, impl, device, meter, args)
    if timing['status'] != 'ok':
        return [dict(timing, kernel_class=ALL)]
    chosen = attention_impl('auto' if impl == bench.NO_IMPL else impl)
    with chosen:
        classes = summarize(profile_steps(fn, device, args.profiled_steps), own, args.profiled_steps)
    kernel_ms = sum(c['time_ms_per_step'] for c in classes.values())
    launched = sum(c['launches_per_step'] for c in classes.values())
    wall_ms = timing['time_ms']
    floor_ms = (
        None
        if args.no_floor
        else step_floor(name, impl, batch, args.size, args.dtype, args.bandwidth_tbs, args.peak_tflops)
    )
    shared = dict(
        case,
        wall_ms=wall_ms,
        kernel_ms=kernel_ms,
        busy=kernel_ms / wall_ms,
        floor_ms=floor_ms,
        wall_vs_floor=wall_ms / floor_ms if floor_ms else None,
        peak_mem_mib=timing['peak_mem_mib'],
        status='ok',
    )
    rows = [dict(shared, kernel_class=ALL, launches_per_step=launched, time_ms_per_step=kernel_ms, share=1.0)]
    for kind, figures in classes.items():
        share = figures['time_ms_per_step'] / kernel_ms if kernel_ms else None
        rows.append(dict(shared, kernel_class=kind, share=share, **figures))
    return rows


def _readable(value):
    """A figure for the tables: whole numbers from 100 up (``bench.format_value`` writes 3 significant
    digits, 1.23e+03 for 1234)."""
    return round(value) if isinstance(value, float) and abs(value) >= 100 else value


def case_table(rows):
    """Markdown: one line per case, its totals and its milliseconds per step by class (``ours``: our kernels
    summed; classes no case has left out).

    Args:
        rows (list[dict]): CSV rows of :func:`profile_case`.
    """
    totals = [row for row in rows if row['kernel_class'] == ALL]
    by_case = collections.defaultdict(collections.Counter)
    for row in rows:
        if row['kernel_class'] != ALL:
            kind = 'ours' if is_own(row['kernel_class']) else row['kernel_class']
            by_case[(row['model'], row['batch'])][kind] += row['time_ms_per_step']
    kinds = [k for k in ('ours',) + KERNEL_CLASSES if any(k in counts for counts in by_case.values())]
    lines = []
    for row in totals:
        line = {k: row.get(k) for k in ('model', 'impl', 'batch', 'status', 'floor_ms', 'wall_vs_floor')}
        line.update(
            wall_ms=row.get('wall_ms'),
            kernel_ms=row.get('kernel_ms'),
            busy=row.get('busy'),
            kernels_per_step=row.get('launches_per_step'),
        )
        line.update({f'{k}_ms': by_case[(row['model'], row['batch'])].get(k) for k in kinds})
        lines.append({key: _readable(value) for key, value in line.items()})
    columns = [
        'model',
        'impl',
        'batch',
        'wall_ms',
        'kernel_ms',
        'busy',
        'kernels_per_step',
        'floor_ms',
        'wall_vs_floor',
    ]
    return bench.format_table(lines, columns + [f'{k}_ms' for k in kinds] + ['status'])


def own_table(rows):
    """Markdown: our kernels, one line per model, batch and kernel.

    Args:
        rows (list[dict]): CSV rows of :func:`profile_case`.
    """
    lines = []
    for row in rows:
        if is_own(row['kernel_class']):
            op, kernel = row['kernel_class'].split(':', 1)
            lines.append({key: _readable(value) for key, value in dict(row, op=op, kernel=kernel).items()})
    columns = ('model', 'batch', 'op', 'kernel', 'launches_per_step', 'time_ms_per_step', 'share')
    return bench.format_table(lines, columns) if lines else '(none of our kernels ran)'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument(
        '--models', default=','.join(DEFAULT_MODELS), help=f'comma-separated, from: {", ".join(MODEL_ZOO)}'
    )
    parser.add_argument('--batches', default='8,2', help='comma-separated batch sizes (ints >= 1), run in this order')
    parser.add_argument('--size', default='800x1333', help='HEIGHTxWIDTH of the images')
    parser.add_argument('--dtype', default='bf16', choices=bench.DTYPES, help='fp32, or bf16 / fp16 autocast')
    parser.add_argument(
        '--impl', default='auto', choices=ATTENTION_IMPLS, help="our backbones' attention path (default: %(default)s)"
    )
    parser.add_argument('--warmup', type=int, default=2, help='untimed steps first, an int >= 0 (default: %(default)s)')
    parser.add_argument(
        '--steps',
        type=int,
        default=3,
        help='timed steps, an int >= 1; the median is the wall time (default: %(default)s)',
    )
    parser.add_argument(
        '--profiled-steps', type=int, default=2, help='steps under the profiler, an int >= 1 (default: %(default)s)'
    )
    parser.add_argument(
        '--bandwidth-tbs', type=float, default=4.8, help="the floor's memory bandwidth, TB/s (default: an H200's, 4.8)"
    )
    parser.add_argument(
        '--peak-tflops',
        type=float,
        default=990.0,
        help="the floor's attention FLOP rate, TFLOP/s (default: an H200's dense bf16 peak, 990)",
    )
    parser.add_argument(
        '--no-floor', action='store_true', help="leave the floor out (one or two traces per case, seconds each)"
    )
    parser.add_argument(
        '--floor-only',
        action='store_true',
        help='only the floors: nothing runs, no GPU needed (the floor is a count of the program, the same anywhere)',
    )
    parser.add_argument('--device', default='cuda', help='cuda, cuda:N or cpu')
    parser.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    parser.add_argument('--out-dir', default='work_dirs/profile_step')
    args = parser.parse_args(argv)
    args.models = bench.check_choices(bench.parse_list(args.models, option='--models'), MODEL_ZOO, '--models')
    args.batches = bench.parse_list(args.batches, int, '--batches')
    if min(args.batches) < 1:
        raise SystemExit(f'--batches: batch sizes must be >= 1, got {args.batches}')
    args.size = bench.parse_size(args.size, '--size')
    if args.warmup < 0 or args.steps < 1 or args.profiled_steps < 1:
        raise SystemExit('--warmup must be >= 0, --steps and --profiled-steps >= 1')
    if args.floor_only and args.no_floor:
        raise SystemExit('--floor-only and --no-floor leave nothing to do: give one of them')
    if args.floor_only:
        args.device = 'cpu'  # nothing runs: no device needed
    if args.bandwidth_tbs <= 0 or args.peak_tflops <= 0:
        raise SystemExit('--bandwidth-tbs and --peak-tflops must be > 0')
    args.repeats = args.steps  # the names bench.measure_case reads
    return args


def main(argv=None):
    args = parse_args(argv)
    device, meter, machine = bench.start_run(args)
    own = own_kernels()
    csv_path = osp.join(args.out_dir, 'profile_step.csv')
    rows, built = [], {}
    with bench.UntilInterrupted('profile_step', lambda: 'the cases') as run:
        for batch in args.batches:
            for name in args.models:
                if args.floor_only:
                    found = [floor_case(name, batch, device, args)]
                else:
                    if name not in built:
                        built[name] = build_backbone(name).to(device)
                    found = profile_case(name, built[name], batch, device, meter, args, own)
                total = found[0]
                figures = {key: bench.format_value(_readable(value)) for key, value in total.items()}
                measured = (
                    ''
                    if args.floor_only
                    else f'wall {figures.get("wall_ms")} ms, kernels {figures.get("kernel_ms")} ms in '
                    f'{figures.get("launches_per_step")} launches, '
                )
                print(f'{name:>9} b{batch}: {measured}floor {figures.get("floor_ms")} ms {total["status"]}', flush=True)
                rows += found
                bench.write_csv(rows, CSV_COLUMNS, csv_path)
    floor = (
        'no floor'
        if args.no_floor
        else f'floor: bytes at {args.bandwidth_tbs:g} TB/s + attention FLOPs at {args.peak_tflops:g} TFLOP/s'
    )
    report = '\n\n'.join(
        (
            f'{machine}; {device.type}; {args.dtype} fwd+bwd {args.size[0]}x{args.size[1]}; wall: median of '
            f'{args.steps} steps after {args.warmup}; kernels: {args.profiled_steps} profiled steps; {floor}; '
            'times in ms per step',
            case_table(rows),
            own_table(rows),
        )
    )
    print('\n' + report)
    bench.write_csv(rows, CSV_COLUMNS, csv_path)
    with open(osp.join(args.out_dir, 'profile_step.md'), 'w') as out:
        out.write(report + '\n')
    print(f'\nwrote {csv_path} and profile_step.md')
    run.exit_if_interrupted()
    return rows


if __name__ == '__main__':
    main()
