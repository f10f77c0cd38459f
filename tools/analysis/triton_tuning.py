"""Times every Triton kernel of a backbone's training step under candidate launch settings, on a GPU.

The launch settings (warps, software-pipeline stages) of the Triton kernels were
chosen by register spills (``tools/analysis/triton_resources.py``), without a GPU.
This tool gives the timings to refine them. For each backbone and dtype it runs
training steps (forward and backward of ``--batch`` images of ``--size``, bf16
under autocast) with ``attn_impl='triton'``, once with the package's settings and
once per candidate of ``--warps`` x ``--stages``; every kernel launch then runs
with the candidate's settings instead, between two CUDA events. The kernels that
add to a bias gradient with atomics (ViL's and ViL-LS' query-side backward) are
also timed, with the package's settings, for each count of ``--bias-grad-copies``
(``visattn_mm.ops.triton.host.BIAS_GRAD_COPIES``, copies of the gradient the
atomics are spread over; 0: no atomics, the bias-gradient kernel's time counted
with the query-side kernel's). The sliding-chunk kernels that can read their keys packed
(``visattn_mm.ops.sliding_chunk.triton.PACK_KEY_TILES``, off in the package) are timed with it on as well,
with the package's settings and each of ``--warps`` (labelled ``packed keys``). Per kernel and head-dim
tile, it reports the median over ``--repeats`` steps of the summed time of its launches: the package's
settings and time, the fastest candidate and its time. It times, it does not check results: a
faster candidate must pass the CUDA tests before it becomes the package's (8 warps
were wrong in 16 bits at head dim 64, see ``host.launch_settings``).
A candidate a kernel cannot be compiled with (too much shared memory, too many
registers) is skipped for that kernel, which then runs with the package's
settings. VVT's token tiles are not varied (they change the grid). Neither copies nor packed keys are
launch settings: ``--write`` passes them over, and a faster one becomes the package's by an edit of its
constant, once the CUDA tests have passed with it.

Writes every candidate's times to ``<out-dir>/triton_tuning.csv``. ``--write`` then puts, per kernel, input
dtype and head-dim tile, the candidate that was at least 5% faster than the package's settings in every
place the kernel ran (summed over models and token tiles) into ``visattn_mm/ops/tuned_launches.py``, which
the launches read (``host.tuned_settings``); ``--from-csv`` reads a device call's CSV instead of measuring.
A written row changes its kernel's compiled code: ``triton_resources.py --digests write`` follows, and the
op's CUDA defaults rows run 'fast' until a GPU has passed the CUDA tests with it and decided them again.

Example (on a GPU host, about 5 minutes for one backbone and dtype), then on the returned CSV::

    python tools/analysis/triton_tuning.py --models vil-s --dtypes bf16 --batch 2
    python tools/analysis/triton_tuning.py --from-csv results/<call>/triton_tuning.csv --write

On the CPU, with ``TRITON_INTERPRET=1``, the kernels run in Triton's interpreter
and host timers replace the events: that checks the plumbing only (tests).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import os.path as osp
import statistics
import time

import torch

from visattn_mm.analysis import benchmarking as bench
from visattn_mm.analysis.benchmark_backbones import COMPARED_MODELS as MODELS
from visattn_mm.analysis.benchmark_backbones import TRITON_DTYPES as DTYPES
from visattn_mm.analysis.benchmark_backbones import training_step

COLUMNS = (
    'model',
    'dtype',
    'kernel',
    'inputs',
    'head_dim',
    'tile',
    'settings',
    'time_ms',
    'best_settings',
    'best_ms',
    'speedup',
)
CSV_COLUMNS = ('device', 'model', 'dtype', 'kernel', 'inputs', 'head_dim', 'tile', 'settings', 'time_ms', 'status')
REPORT_COLUMNS = ('kernel', 'inputs', 'head_dim', 'package', 'best', 'speedup', 'written', 'models')
PACKAGE = 'package'  # the candidate that keeps the package's settings
MIN_SPEEDUP = 1.05  # what a candidate must gain over the package's settings to be written (timing noise)
TUNED_FILE = osp.join(
    osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__)))), 'visattn_mm', 'ops', 'tuned_launches.py'
)


def settings_label(settings):
    return f"{settings['num_warps']}w{settings.get('num_stages', 3)}s"


def parse_settings_label(label):
    """``dict(num_warps=8, num_stages=1)`` for ``'8w1s'``."""
    warps, stages = label.rstrip('s').split('w')
    return dict(num_warps=int(warps), num_stages=int(stages))


def kernel_times(model, image, dtype, candidate, repeats, bias_grad_copies=None, packed_keys=False):
    """Per kernel launched by a training step of ``model``, its median time over ``repeats`` steps.

    Args:
        model (nn.Module): A backbone built with ``attn_impl='triton'``, on the image's device.
        image (Tensor): ``(B, 3, H, W)``.
        dtype (str): 'fp32' or 'bf16' (autocast).
        candidate (dict | None): ``num_warps`` and ``num_stages`` (or one of them, the other the package's)
            for every launch; None keeps the package's settings.
        repeats (int): Timed steps, after one that compiles.
        bias_grad_copies (int, optional): Runs the steps with this ``triton.host.BIAS_GRAD_COPIES``
            and times only the kernels that take it; None keeps the package's and times every kernel.
        packed_keys (bool): Runs the steps with the sliding-chunk kernels' packed key tiles on and times only
            the kernels that read them.

    Returns:
        dict: ``(kernel, input dtype, head-dim tile, token tile) -> (settings label, milliseconds or None)``;
        None where the candidate did not compile for that kernel. The label of a kernel that spreads
        atomics over bias-gradient copies names their count.
    """
    from triton.runtime.errors import OutOfResources

    import visattn_mm.ops.sliding_chunk.triton as sliding_chunk
    import visattn_mm.ops.triton.host as host

    cuda = image.device.type == 'cuda'
    launches, labels, failed = [], {}, set()
    copies = host.BIAS_GRAD_COPIES if bias_grad_copies is None else bias_grad_copies

    def timed_launch(kernel, grid, settings, *args, **constexprs):
        # The kernel that sums a bias gradient without atomics (0 copies) does the atomics' share of the
        # query-side kernel's work: its time counts as that kernel's.
        takes_copies = 'bias_copies' in kernel.arg_names or 'grad_parts' in kernel.arg_names
        packs = packed_keys and kernel.fn.__name__ in sliding_chunk.PACKED_KEY_KERNELS
        if (bias_grad_copies is not None and not takes_copies) or (packed_keys and not packs):
            kernel[grid](*args, **settings, **constexprs)
            return
        name = kernel.fn.__name__.replace('_bias_grad', '_backward_queries')
        key = (name, host.input_dtype(args), *host.launch_tiles(constexprs))
        package = host.tuned_settings(kernel, settings, args, constexprs)
        chosen = package if candidate is None or key in failed else dict(package, **candidate)
        try:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                kernel[grid](*args, **chosen, **constexprs)
                end.record()
                launches.append((key, lambda: start.elapsed_time(end)))
            else:
                begin = time.perf_counter()
                kernel[grid](*args, **chosen, **constexprs)
                seconds = time.perf_counter() - begin
                launches.append((key, lambda: seconds * 1e3))
            labels[key] = settings_label(chosen) + (f', {copies} copies' if takes_copies else '')
            labels[key] += ', packed keys' if packs else ''
        except OutOfResources:
            if chosen is package:
                raise
            failed.add(key)
            timed_launch(kernel, grid, settings, *args, **constexprs)

    per_step = collections.defaultdict(list)
    saved = host.launch, host.BIAS_GRAD_COPIES, sliding_chunk.PACK_KEY_TILES
    host.launch, host.BIAS_GRAD_COPIES = timed_launch, copies
    sliding_chunk.PACK_KEY_TILES = packed_keys or sliding_chunk.PACK_KEY_TILES
    try:
        for step in range(repeats + 1):
            launches.clear()
            training_step(model, image, dtype)
            bench.synchronize(image.device)
            if step:  # the first step compiles
                totals = collections.Counter()
                for key, elapsed in launches:
                    totals[key] += elapsed()
                for key, total in totals.items():
                    per_step[key].append(total)
    finally:
        host.launch, host.BIAS_GRAD_COPIES, sliding_chunk.PACK_KEY_TILES = saved
    return {key: (labels[key], None if key in failed else statistics.median(times)) for key, times in per_step.items()}


def tune(name, dtype, args, device):
    """Rows of every candidate for backbone ``name`` in ``dtype``: see :data:`CSV_COLUMNS`."""
    import visattn_mm.models as models
    import visattn_mm.ops.sliding_chunk.triton as sliding_chunk

    class_name, arch = MODELS[name]
    torch.manual_seed(0)
    model = getattr(models, class_name)(arch=arch, attn_impl='triton').to(device).train()
    image = torch.randn(args.batch, 3, *args.size, device=device)
    gpu = torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (Triton interpreter)'
    rows = []

    def timed(candidate, copies=None, packed_keys=False):
        for (kernel, inputs, head_dim, tile), (label, ms) in kernel_times(
            model, image, dtype, candidate, args.repeats, copies, packed_keys
        ).items():
            rows.append(
                dict(
                    device=gpu,
                    model=name,
                    dtype=dtype,
                    kernel=kernel,
                    inputs=inputs,
                    head_dim=head_dim,
                    tile=tile,
                    settings=PACKAGE + f' ({label})'
                    if (candidate, copies, packed_keys) == (None, None, False)
                    else label,
                    time_ms=ms,
                    status='ok' if ms is not None else 'does not compile',
                )
            )

    timed(None)
    for warps, stages in itertools.product(args.warps, args.stages):
        timed(dict(num_warps=warps, num_stages=stages))
    if any('copies' in row['settings'] for row in rows):  # a kernel spreads bias-gradient atomics over copies
        for copies in args.bias_grad_copies:
            timed(None, copies)
    if any(row['kernel'] in sliding_chunk.PACKED_KEY_KERNELS for row in rows):
        # Packed, a tile's indices carry more registers (ptxas, sm_90, bf16, head dim 32: the three kernels spill
        # 52-148 bytes per thread with 4 warps, 0-60 with 8).
        timed(None, packed_keys=True)
        for warps in args.warps:
            timed(dict(num_warps=warps), packed_keys=True)
    return rows


def best_rows(rows):
    """Per (model, dtype, kernel, head-dim tile, token tile): the package's time and the fastest candidate."""
    groups = collections.defaultdict(list)
    for row in rows:
        groups[tuple(row[c] for c in COLUMNS[:6])].append(row)
    table = []
    for key, group in groups.items():
        package = next(r for r in group if r['settings'].startswith(PACKAGE))
        timed = [r for r in group if r['time_ms'] is not None and not r['settings'].startswith(PACKAGE)]
        best = min(timed, key=lambda r: r['time_ms'], default=package)
        table.append(
            dict(
                zip(COLUMNS[:6], key),
                settings=package['settings'],
                time_ms=package['time_ms'],
                best_settings=best['settings'],
                best_ms=best['time_ms'],
                speedup=package['time_ms'] / best['time_ms'],
            )
        )
    return table


def split_label(label):
    """``('8w1s', ', 32 copies')`` for ``'package (8w1s, 32 copies)'`` or ``'8w1s, 32 copies'``."""
    inner = label[len(PACKAGE) + 2 : -1] if label.startswith(PACKAGE) else label
    settings, comma, copies = inner.partition(',')
    return settings, comma + copies


def chosen_launches(rows, current):
    """The tuned-launch table after the timings ``rows`` (:data:`CSV_COLUMNS`, as the CSV gives them).

    Per (kernel, input dtype, head-dim tile) the rows time, the candidate with the least time summed over
    every (model, dtype, token tile) where the package's settings ran, which it must have compiled for all
    of; it replaces the package's settings where that sum is at least :data:`MIN_SPEEDUP` times the
    candidate's. Other kernels keep their row of ``current``, or none. Candidates of the bias-gradient
    copies (``--bias-grad-copies``) are not launch settings and are passed over.

    Args:
        rows (list[dict]): Rows of :func:`tune` or of its CSV (strings; an empty time: did not compile).
        current (dict): The table in the package, ``{(kernel, inputs, head_dim): settings}``.

    Returns:
        tuple: The new table, and a report row per timed kernel (its package and best settings, the
        speedup, whether it was written).
    """
    package, candidates = {}, collections.defaultdict(dict)
    for row in rows:
        place = (row['kernel'], row['inputs'], int(row['head_dim']))
        run = (row['model'], row['dtype'], int(row['tile']))
        ms = None if row['time_ms'] in (None, '') else float(row['time_ms'])
        if row['settings'].startswith(PACKAGE):
            package[place, run] = (row['settings'], ms)
        else:
            candidates[place, run][row['settings']] = ms
    places = collections.defaultdict(list)
    for (place, run), (label, ms) in package.items():
        places[place].append((run, label, ms))
    table, report = dict(current), []
    for place, runs in places.items():
        package_ms = sum(ms for _, _, ms in runs)
        totals = {}  # settings label -> summed time, of the candidates timed wherever the package's were
        for label in set.intersection(*(set(candidates[place, run]) for run, _, _ in runs)):
            times = [candidates[place, run][label] for run, _, _ in runs]
            same_copies = all(split_label(label)[1] == split_label(package_label)[1] for _, package_label, _ in runs)
            if same_copies and all(ms is not None for ms in times):
                totals[split_label(label)[0]] = sum(times)
        best = min(totals.items(), key=lambda item: item[1], default=(None, package_ms))
        speedup = package_ms / best[1]
        written = best[0] is not None and speedup >= MIN_SPEEDUP
        if written:
            table[place] = parse_settings_label(best[0])
        report.append(
            dict(
                kernel=place[0],
                inputs=place[1],
                head_dim=place[2],
                package=split_label(runs[0][1])[0],
                best=best[0],
                speedup=speedup,
                written='yes' if written else 'no',
                models=' '.join(sorted({run[0] for run, _, _ in runs})),
            )
        )
    return table, report


def tuned_source(table, sources):
    """The generated part of ``visattn_mm/ops/tuned_launches.py``: where the rows were measured, then a line
    per row, in kernel order (formatted as ruff formats it)."""

    def block(opening, items, closing):
        return [opening + closing] if not items else [opening, *(f'    {item},' for item in items), closing]

    rows = [
        f'{key!r}: dict({", ".join(f"{name}={value}" for name, value in sorted(table[key].items()))})'
        for key in sorted(table)
    ]
    lines = block('TUNED_FROM = [', [repr(source) for source in sources], ']') + block('TUNED_LAUNCHES = {', rows, '}')
    return '\n'.join(lines) + '\n'


def write_tuned(table, sources, path=TUNED_FILE):
    """Replaces the generated part of the tuned-launch module (from ``TUNED_FROM`` on) with ``table``."""
    text = open(path).read()
    with open(path, 'w') as file:
        file.write(text[: text.index('TUNED_FROM = ')] + tuned_source(table, sources))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default=','.join(MODELS), help=f'comma-separated, of {", ".join(MODELS)}')
    parser.add_argument('--dtypes', default=','.join(DTYPES), help='comma-separated, of fp32, bf16')
    parser.add_argument('--size', default='800x1333', help='input HxW (default 800x1333)')
    parser.add_argument('--batch', type=int, default=2, help='images per step (default 2)')
    parser.add_argument('--warps', default='4,8,16', help='candidate warps per program (default 4,8,16)')
    parser.add_argument('--stages', default='1,2,3', help='candidate pipeline stages (default 1,2,3)')
    parser.add_argument(
        '--bias-grad-copies',
        default='0,1,8,32,128',
        help='candidate copies of a bias gradient for the atomics, 0 for none (default 0,1,8,32,128)',
    )
    parser.add_argument('--repeats', type=int, default=3, help='timed steps per candidate (default 3)')
    parser.add_argument('--device', default='cuda', help='cuda (cpu: Triton interpreter, for tests)')
    parser.add_argument('--out-dir', default='work_dirs/triton_tuning', help='where the CSV goes')
    parser.add_argument(
        '--from-csv', metavar='CSV', help="a triton_tuning.csv to choose from instead of measuring (a device call's)"
    )
    parser.add_argument(
        '--write',
        action='store_true',
        help=f'put the chosen settings (at least {MIN_SPEEDUP}x faster) into visattn_mm/ops/tuned_launches.py',
    )
    parser.add_argument('--tuned-file', default=TUNED_FILE, help=argparse.SUPPRESS)  # tests write elsewhere
    args = parser.parse_args(argv)
    args.models = bench.check_choices(bench.parse_list(args.models, str, '--models'), MODELS, '--models')
    args.dtypes = bench.check_choices(bench.parse_list(args.dtypes, str, '--dtypes'), DTYPES, '--dtypes')
    args.size = bench.parse_size(args.size, '--size')
    args.warps = bench.parse_list(args.warps, int, '--warps')
    args.stages = bench.parse_list(args.stages, int, '--stages')
    args.bias_grad_copies = bench.parse_list(args.bias_grad_copies, int, '--bias-grad-copies')
    if args.batch < 1 or args.repeats < 1 or min(args.bias_grad_copies) < 0:
        raise SystemExit('--batch and --repeats must be at least 1, --bias-grad-copies at least 0')
    return args


def main(argv=None):
    args = parse_args(argv)
    table = None
    if args.from_csv:
        rows, csv_path = bench.read_csv(args.from_csv), args.from_csv
    else:
        device = bench.resolve_device(args.device)
        if device.type == 'cpu' and not os.environ.get('TRITON_INTERPRET'):
            raise SystemExit('--device cpu runs the kernels in Triton\'s interpreter: set TRITON_INTERPRET=1')
        if device.type == 'cpu':
            from visattn_mm.ops.triton.interpreter import speed_up_the_interpreter

            speed_up_the_interpreter()
        print(bench.machine_description(device), flush=True)
        rows = [row for name in args.models for dtype in args.dtypes for row in tune(name, dtype, args, device)]
        csv_path = osp.join(args.out_dir, 'triton_tuning.csv')
        bench.write_csv(rows, CSV_COLUMNS, csv_path)
        table = best_rows(rows)
        print(
            f'Triton kernels of a training step, {args.batch}x{args.size[0]}x{args.size[1]}: median ms per step '
            f'over {args.repeats} steps, package settings and fastest candidate (warps w, stages s)\n'
        )
        print(bench.format_table(table, COLUMNS))
    if args.from_csv or args.write:
        from visattn_mm.ops import tuned_launches

        tuned, report = chosen_launches(rows, tuned_launches.TUNED_LAUNCHES)
        print(f'\nPer kernel, input dtype and head-dim tile, summed over every place it ran ({csv_path}):\n')
        print(bench.format_table(report, REPORT_COLUMNS))
        if args.write:
            devices = ', '.join(sorted({row['device'] for row in rows}))
            write_tuned(tuned, [*tuned_launches.TUNED_FROM, f'{devices}: {csv_path}'], args.tuned_file)
            print(
                f'\nwrote {args.tuned_file}; then `.venv/bin/python tools/analysis/triton_resources.py --digests '
                'write`, and the CUDA tests and decision rows of the ops whose digest changed on a GPU'
            )
    return table


if __name__ == '__main__':
    main()
