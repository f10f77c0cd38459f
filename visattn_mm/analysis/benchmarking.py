"""Measurement plumbing of the benchmark tools (``tools/analysis/benchmark.py``, ``attention_benchmark.py``,
``train_throughput.py``, ``profile_step.py``, ...): timing, peak memory, option parsing, tables, CSV and plots.

Time: the median of ``repeats`` calls after ``warmup`` calls, with
``torch.cuda.synchronize`` around each call on CUDA.

Peak memory, always the memory a call needs on top of what existed before it
(model, inputs):

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
  minus ``memory_allocated`` before the call.
* CPU: torch has no CPU allocator statistics, so the process's resident set is
  used. Before the call, memory that glibc keeps after ``free`` is handed back to
  the kernel (``malloc_trim``; since glibc 2.8 it also releases free pages inside
  the heap, so memory kept from an earlier call must be faulted in again and is
  counted), and the kernel's peak-RSS mark is reset (writing ``5`` to
  ``/proc/self/clear_refs``, Linux >= 4.0). The call's peak is ``VmHWM`` after it
  minus ``VmRSS`` before it. Pages that a call allocates but never touches are not
  resident and are not counted. Timed calls run with the allocator left as it is.
  ``tests/test_tools/test_benchmark_tools.py`` checks that known allocations measure right.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import ctypes.util
import gc
import os
import os.path as osp
import platform
import statistics
import time

import torch

from visattn_mm.ops.impl import ATTENTION_IMPLS, attention_impl

MIB = 2**20
GIB = 2**30
AUTOCAST_DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}
DTYPES = ('fp32',) + tuple(AUTOCAST_DTYPES)
MODES = ('fwd', 'fwd+bwd')


def parse_list(text, convert=str, option='value'):
    """``'a,b, c'`` -> ``[convert('a'), convert('b'), convert('c')]``.

    Raises:
        SystemExit: naming ``option`` when an item does not convert or the list is empty.
    """
    try:
        items = [convert(item.strip()) for item in text.split(',') if item.strip()]
    except ValueError:
        raise SystemExit(f'{option}: cannot read {text!r} as a comma-separated list of {convert.__name__}') from None
    if not items:
        raise SystemExit(f'{option}: empty list')
    return items


def parse_size(text, option):
    """``'800x1333'`` -> ``(800, 1333)`` (height x width).

    Raises:
        SystemExit: naming ``option`` when ``text`` is not a size of at least 32x32.
    """
    try:
        height, width = (int(v) for v in text.lower().split('x'))
    except ValueError:
        raise SystemExit(f'{option}: {text!r} is not HEIGHTxWIDTH, e.g. 800x1333') from None
    if height < 32 or width < 32:
        raise SystemExit(f'{option}: {text!r} is smaller than 32x32, the backbones\' total stride')
    return height, width


def check_choices(values, allowed, option):
    """Raises SystemExit naming the option when ``values`` holds something not ``allowed``."""
    unknown = [v for v in values if v not in allowed]
    if unknown:
        raise SystemExit(f'{option}: unknown value(s) {unknown}; choose from {list(allowed)}')
    return values


def check_run_options(args):
    """Parses and checks the options the benchmark tools share (dtypes, impls, modes, repeats).

    Raises:
        SystemExit: naming the option that cannot work.
    """
    args.dtypes = check_choices(parse_list(args.dtypes), DTYPES, '--dtypes')
    args.impls = check_choices(parse_list(args.impls), ATTENTION_IMPLS, '--impls')
    args.modes = check_choices(parse_list(args.modes), MODES, '--modes')
    if args.repeats < 1 or args.warmup < 0:
        raise SystemExit('--repeats must be >= 1 and --warmup >= 0')


def start_run(args):
    """Threads, device, memory meter and a printed machine line for one run.

    Returns:
        tuple: ``(device, meter, machine description)``.
    """
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    meter = memory_meter(device)
    machine = machine_description(device)
    print(machine, flush=True)
    torch.manual_seed(0)
    return device, meter, machine


NO_IMPL = '-'  # the impl column of cases that do not run our attention ops


class UntilInterrupted:
    """A ``with`` block of measurements that an interrupt (Ctrl-C, or a time limit: ``timeout -s INT``) ends
    early without losing what was measured: the interrupt ends the block with one line, the tool reports
    what it has, then :meth:`exit_if_interrupted` exits with an error.

    Args:
        tool (str): The tool's name, in the messages.
        measured (Callable[[], str]): What was measured so far, e.g. ``lambda: f'the {len(rows)} rows'``.
    """

    def __init__(self, tool, measured):
        self.tool = tool
        self.measured = measured
        self.interrupted = False

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is None or not issubclass(kind, KeyboardInterrupt):
            return False
        self.interrupted = True
        print(f'\n[{self.tool}] interrupted: reporting {self.measured()} measured until then', flush=True)
        return True

    def exit_if_interrupted(self):
        """Exit with an error if the block was interrupted (after the report)."""
        if self.interrupted:
            raise SystemExit(f'[{self.tool}] interrupted before all cases were measured')


def measure_case(row, fn, impl, device, meter, args):
    """Times ``fn`` under attention implementation ``impl`` and records it in ``row``.

    A failure (e.g. out of memory) is recorded as the row's status, so one
    case cannot end the run.
    """
    chosen = contextlib.nullcontext() if impl == NO_IMPL else attention_impl(impl)
    try:
        with chosen:
            seconds, peak = measure(fn, device, meter, args.warmup, args.repeats)
        row.update(time_ms=seconds * 1e3, peak_mem_mib=peak / MIB, status='ok')
    except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
        row['status'] = f'failed: {str(error).splitlines()[0][:120]}'


def resolve_device(name):
    """``torch.device`` for ``name``, or SystemExit saying why it cannot be used."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f'--device {name}: not a device name; use cpu, cuda or cuda:N') from None
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise SystemExit(f'--device {name}: CUDA is not available here; use --device cpu')
    if device.type not in ('cpu', 'cuda'):
        raise SystemExit(f'--device {name}: only cpu and cuda are supported')
    return device


def autocast(device, dtype, cache_casts=True):
    """Context for ``dtype`` ('fp32', 'bf16', 'fp16'): nothing for fp32, else autocast, which keeps its casts of
    the weights for the context's length unless ``cache_casts`` is False (what CUDA graph capture needs)."""
    if dtype == 'fp32':
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[dtype], cache_enabled=cache_casts)


@contextlib.contextmanager
def deterministic_algorithms(enabled=True):
    """Inside, ``torch.use_deterministic_algorithms(enabled)``, warn only (a run sets no cuBLAS workspace); the
    process's setting (and its warn-only flag) afterwards. Deterministic, the Triton window ops sum the RPB
    gradients without atomics (:func:`visattn_mm.ops.triton.host.bias_grad_parts`)."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def synchronize(device):
    """Waits for queued CUDA work so that host timers see it; no-op on CPU."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def _read_status_bytes(field):
    with open('/proc/self/status') as status:
        for line in status:
            if line.startswith(field + ':'):
                return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError(f'/proc/self/status has no {field} line')


class CpuPeakMemory:
    """Peak resident memory of a call on top of the resident memory before it (see module doc)."""

    def __init__(self):
        if not osp.exists('/proc/self/clear_refs'):
            raise SystemExit(
                'CPU peak memory needs Linux /proc/self/clear_refs (kernel >= 4.0); run on Linux or use --device cuda'
            )
        libc_name = ctypes.util.find_library('c')
        self._libc = ctypes.CDLL(libc_name) if libc_name else None
        self._base = None

    def start(self):
        gc.collect()
        if self._libc is not None and hasattr(self._libc, 'malloc_trim'):
            self._libc.malloc_trim(0)
        with open('/proc/self/clear_refs', 'w') as refs:
            refs.write('5')  # resets VmHWM to the current RSS
        self._base = _read_status_bytes('VmRSS')

    def peak(self):
        """Bytes above the resident memory at :meth:`start`."""
        return max(0, _read_status_bytes('VmHWM') - self._base)


class CudaPeakMemory:
    """Peak allocated CUDA memory of a call on top of the memory allocated before it."""

    def __init__(self, device):
        self._device = device
        self._base = None

    def start(self):
        gc.collect()
        torch.cuda.synchronize(self._device)
        torch.cuda.reset_peak_memory_stats(self._device)
        self._base = torch.cuda.memory_allocated(self._device)

    def peak(self):
        torch.cuda.synchronize(self._device)
        return max(0, torch.cuda.max_memory_allocated(self._device) - self._base)


def memory_meter(device):
    """The peak-memory meter for ``device``."""
    return CudaPeakMemory(device) if device.type == 'cuda' else CpuPeakMemory()


class CapturedStep:
    """A no-argument CUDA step ``fn`` run as a CUDA graph: the first call runs it ``warmup`` times on a side
    stream (capture needs its kernels chosen and compiled, the allocator's blocks settled), captures one
    call under ``meter`` and replays it; every later call replays it. Replays read and write the memory the
    capture used: ``fn``'s inputs and parameters must stay where they are, and under autocast ``fn`` must
    not keep its casts (``autocast(..., cache_casts=False)``). A host sync inside ``fn`` fails the capture
    with a RuntimeError.

    Attributes:
        capture_peak (int | None): The captured call's peak bytes on top of what was allocated before it:
            the memory the graph's pool keeps for its replays (a replay allocates nothing). None before
            the first call.
    """

    def __init__(self, fn, meter, warmup=3):
        self.fn, self.meter, self.warmup = fn, meter, warmup
        self.graph, self.capture_peak = None, None

    def __call__(self):
        if self.graph is None:
            self._capture()
        self.graph.replay()

    def _capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        self.meter.start()
        with torch.cuda.graph(graph):
            self.fn()
        self.capture_peak = self.meter.peak()
        self.graph = graph


def measure(fn, device, meter, warmup, repeats):
    """Runs ``fn()`` ``warmup`` times, once under ``meter``, then ``repeats`` timed times.

    Returns:
        tuple[float, int]: median seconds per call and peak bytes of one call.
    """
    if repeats < 1:
        raise ValueError(f'repeats must be >= 1, got {repeats}')
    for _ in range(warmup):
        fn()
    synchronize(device)
    meter.start()
    fn()
    peak = meter.peak()
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        begin = time.perf_counter()
        fn()
        synchronize(device)
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds), peak


def add_ratio_columns(rows, baseline, match_keys, value_keys, name_key='model'):
    """Adds ``<value>_vs_<baseline>`` to each row: its value over the baseline's value
    in the row of the same run that has ``name_key == baseline`` and equal ``match_keys``.

    Rows without such a baseline row (or with a missing value) get ``None``.

    Args:
        rows (list[dict]): Measurements; modified in place and returned.
        baseline (str): The ``name_key`` value of the baseline rows.
        match_keys (Sequence[str]): Fields that must agree with the baseline row.
        value_keys (Sequence[str]): Fields to divide.
        name_key (str): Field naming what was measured.
    """
    reference = {tuple(row[k] for k in match_keys): row for row in rows if row[name_key] == baseline}
    for row in rows:
        base = reference.get(tuple(row[k] for k in match_keys))
        for key in value_keys:
            value = row.get(key)
            base_value = None if base is None else base.get(key)
            row[f'{key}_vs_{baseline}'] = value / base_value if value is not None and base_value else None
    return rows


def format_value(value):
    """Table/CSV text for a value: floats with 3 significant digits, None as empty."""
    if value is None:
        return ''
    if isinstance(value, float):
        return f'{value:.3g}'
    return str(value)


def format_table(rows, columns):
    """Markdown table of ``rows`` restricted to ``columns``."""
    lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
    for row in rows:
        lines.append('| ' + ' | '.join(format_value(row.get(c)) for c in columns) + ' |')
    return '\n'.join(lines)


def write_csv(rows, columns, path):
    """Writes ``rows`` (only ``columns``, in that order) to ``path``, whole or not at all (a run
    killed while writing leaves the previous file)."""
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    with open(path + '.part', 'w', newline='') as out:
        writer = csv.DictWriter(out, fieldnames=list(columns), extrasaction='ignore')
        writer.writeheader()
        for row in rows:
            writer.writerow({c: format_value(row.get(c)) for c in columns})
    os.replace(path + '.part', path)


def read_csv(path):
    """The rows of a CSV file (as :func:`write_csv` writes them) as dicts of strings."""
    with open(path, newline='') as file:
        return list(csv.DictReader(file))


def machine_description(device):
    """One line naming the processor (or GPU), core count, torch version and threads."""
    cpu = platform.processor() or 'unknown CPU'
    if osp.exists('/proc/cpuinfo'):
        with open('/proc/cpuinfo') as info:
            names = [line.split(':', 1)[1].strip() for line in info if line.startswith('model name')]
        cpu = names[0] if names else cpu
    text = f'CPU: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads'
    if device.type == 'cuda':
        text += f'; GPU: {torch.cuda.get_device_name(device)}'
    return text


def plot_growth(series, x_label, path, title):
    """Log-log plot of time (left) and peak memory (right) against a size.

    One colour per group (model or attention), one line style and marker per
    variant (implementation, mode, dtype, ...). Dashed grey guides of slope 1
    (linear) and 2 (quadratic) start at the smallest measured point of each panel,
    so that growth can be read off against them.

    Args:
        series (dict[tuple[str, str], list[tuple[float, float, float]]]):
            ``(group, variant)`` -> points ``(size, milliseconds, MiB)``.
        x_label (str): Axis label of the size.
        path (str): PNG to write.
        title (str): Figure title.

    Returns:
        bool: Whether the PNG was written: not where matplotlib is missing (a bare GPU host),
        which is said on stdout instead of ending a run whose numbers are already measured.
    """
    try:
        import matplotlib
    except ImportError as error:
        print(f'[plot] matplotlib cannot be imported ({error}); {path} not written', flush=True)
        return False
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    groups = sorted({group for group, _ in series})
    variants = sorted({variant for _, variant in series})
    colours = plt.get_cmap('tab10' if len(groups) <= 10 else 'tab20')
    styles = ('-', '--', ':', '-.')
    markers = ('o', 's', '^', 'v', 'D', 'x', '+', '*')
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    y_labels = ('time per call (ms)', 'peak memory (MiB)')
    for column, (axis, y_label) in enumerate(zip(axes, y_labels)):
        measured = []
        for (group, variant), points in sorted(series.items()):
            points = sorted(p for p in points if p[column + 1])
            if not points:
                continue
            index = variants.index(variant)
            axis.plot(
                [p[0] for p in points],
                [p[column + 1] for p in points],
                color=colours(groups.index(group)),
                linestyle=styles[index % len(styles)],
                marker=markers[index % len(markers)],
                markersize=4,
                linewidth=1.2,
                label=f'{group} {variant}',
            )
            measured += [(p[0], p[column + 1]) for p in points]
        if len({x for x, _ in measured}) > 1:
            x0 = min(x for x, _ in measured)
            x1 = max(x for x, _ in measured)
            y0 = min(y for x, y in measured if x == x0)
            for slope, name in ((1, 'linear'), (2, 'quadratic')):
                y1 = y0 * (x1 / x0) ** slope
                axis.plot([x0, x1], [y0, y1], linestyle='--', color='grey', linewidth=0.8)
                axis.annotate(name, (x1, y1), fontsize=7, color='grey')
        axis.set_xscale('log')
        axis.set_yscale('log')
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.xaxis.set_minor_formatter(ScalarFormatter())
        axis.tick_params(axis='x', which='both', labelsize=6, labelrotation=45)
        axis.set_xlabel(x_label)
        axis.set_ylabel(y_label)
        axis.grid(True, which='both', linewidth=0.3)
    axes[1].legend(fontsize=6, loc='upper left', bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(osp.dirname(osp.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True
