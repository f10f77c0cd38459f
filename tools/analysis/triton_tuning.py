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
with the query-side kernel's). Per kernel and head-dim tile, it reports the median over
``--repeats`` steps of the summed time of its launches: the package's settings and
time, the fastest candidate and its time. It times, it does not check results: a
faster candidate must pass the CUDA tests before it becomes the package's (8 warps
were wrong in 16 bits at head dim 64, see ``host.launch_settings``).
A candidate a kernel cannot be compiled with (too much shared memory, too many
registers) is skipped for that kernel, which then runs with the package's
settings. VVT's token tiles are not varied (they change the grid).

Writes every candidate's times to ``<out-dir>/triton_tuning.csv``.

Example (on a GPU host, about 5 minutes for one backbone and dtype)::

    python tools/analysis/triton_tuning.py --models vil-s --dtypes bf16 --batch 2

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

COLUMNS = ('model', 'dtype', 'kernel', 'head_dim', 'tile', 'settings', 'time_ms', 'best_settings', 'best_ms', 'speedup')
CSV_COLUMNS = ('model', 'dtype', 'kernel', 'head_dim', 'tile', 'settings', 'time_ms', 'status')
PACKAGE = 'package'  # the candidate that keeps the package's settings


def settings_label(settings):
    return f"{settings['num_warps']}w{settings.get('num_stages', 3)}s"


def kernel_times(model, image, dtype, candidate, repeats, bias_grad_copies=None):
    """Per kernel launched by a training step of ``model``, its median time over ``repeats`` steps.

    Args:
        model (nn.Module): A backbone built with ``attn_impl='triton'``, on the image's device.
        image (Tensor): ``(B, 3, H, W)``.
        dtype (str): 'fp32' or 'bf16' (autocast).
        candidate (dict | None): ``num_warps`` and ``num_stages`` for every launch; None keeps the
            package's settings.
        repeats (int): Timed steps, after one that compiles.
        bias_grad_copies (int, optional): Runs the steps with this ``triton.host.BIAS_GRAD_COPIES``
            and times only the kernels that take it; None keeps the package's and times every kernel.

    Returns:
        dict: ``(kernel, head-dim tile, token tile) -> (settings label, milliseconds or None)``; None
        where the candidate did not compile for that kernel. The label of a kernel that spreads atomics
        over bias-gradient copies names their count.
    """
    from triton.runtime.errors import OutOfResources

    import visattn_mm.ops.triton.host as host

    cuda = image.device.type == 'cuda'
    launches, labels, failed = [], {}, set()
    copies = host.BIAS_GRAD_COPIES if bias_grad_copies is None else bias_grad_copies

    def timed_launch(kernel, grid, settings, *args, **constexprs):
        # The kernel that sums a bias gradient without atomics (0 copies) does the atomics' share of the
        # query-side kernel's work: its time counts as that kernel's.
        takes_copies = 'bias_copies' in kernel.arg_names or 'grad_parts' in kernel.arg_names
        if bias_grad_copies is not None and not takes_copies:
            kernel[grid](*args, **settings, **constexprs)
            return
        name = kernel.fn.__name__.replace('_bias_grad', '_backward_queries')
        key = (name, *host.launch_tiles(constexprs))
        chosen = settings if candidate is None or key in failed else candidate
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
        except OutOfResources:
            if chosen is settings:
                raise
            failed.add(key)
            timed_launch(kernel, grid, settings, *args, **constexprs)

    per_step = collections.defaultdict(list)
    saved = host.launch, host.BIAS_GRAD_COPIES
    host.launch, host.BIAS_GRAD_COPIES = timed_launch, copies
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
        host.launch, host.BIAS_GRAD_COPIES = saved
    return {key: (labels[key], None if key in failed else statistics.median(times)) for key, times in per_step.items()}


def tune(name, dtype, args, device):
    """Rows of every candidate for backbone ``name`` in ``dtype``: see :data:`CSV_COLUMNS`."""
    import visattn_mm.models as models

    class_name, arch = MODELS[name]
    torch.manual_seed(0)
    model = getattr(models, class_name)(arch=arch, attn_impl='triton').to(device).train()
    image = torch.randn(args.batch, 3, *args.size, device=device)
    rows = []

    def timed(candidate, copies=None):
        for (kernel, head_dim, tile), (label, ms) in kernel_times(
            model, image, dtype, candidate, args.repeats, copies
        ).items():
            rows.append(
                dict(
                    model=name,
                    dtype=dtype,
                    kernel=kernel,
                    head_dim=head_dim,
                    tile=tile,
                    settings=PACKAGE + f' ({label})' if (candidate, copies) == (None, None) else label,
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
    return rows


def best_rows(rows):
    """Per (model, dtype, kernel, head-dim tile, token tile): the package's time and the fastest candidate."""
    groups = collections.defaultdict(list)
    for row in rows:
        groups[tuple(row[c] for c in COLUMNS[:5])].append(row)
    table = []
    for key, group in groups.items():
        package = next(r for r in group if r['settings'].startswith(PACKAGE))
        timed = [r for r in group if r['time_ms'] is not None and not r['settings'].startswith(PACKAGE)]
        best = min(timed, key=lambda r: r['time_ms'], default=package)
        table.append(
            dict(
                zip(COLUMNS[:5], key),
                settings=package['settings'],
                time_ms=package['time_ms'],
                best_settings=best['settings'],
                best_ms=best['time_ms'],
                speedup=package['time_ms'] / best['time_ms'],
            )
        )
    return table


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
    device = bench.resolve_device(args.device)
    if device.type == 'cpu' and not os.environ.get('TRITON_INTERPRET'):
        raise SystemExit('--device cpu runs the kernels in Triton\'s interpreter: set TRITON_INTERPRET=1')
    print(bench.machine_description(device), flush=True)
    rows = [row for name in args.models for dtype in args.dtypes for row in tune(name, dtype, args, device)]
    bench.write_csv(rows, CSV_COLUMNS, osp.join(args.out_dir, 'triton_tuning.csv'))
    table = best_rows(rows)
    print(
        f'Triton kernels of a training step, {args.batch}x{args.size[0]}x{args.size[1]}: median ms per step '
        f'over {args.repeats} steps, package settings and fastest candidate (warps w, stages s)\n'
    )
    print(bench.format_table(table, COLUMNS))
    return table


if __name__ == '__main__':
    main()
