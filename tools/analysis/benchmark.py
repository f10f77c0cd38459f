"""Backbone benchmark: time per call and peak memory against mmdet's Swin-T and ResNet-50.

Every backbone (ours and the baselines) is built in this process and run on a
``(B, 3, H, W)`` tensor: forward alone (eval mode, no autograd) and forward +
backward (train mode, loss = sum of the outputs' means). Each case reports the
median time of ``--repeats`` calls after ``--warmup`` calls and the peak memory
of one call on top of the model and input (method: ``visattn_mm.analysis.benchmarking``), with
ratios to the baseline (``--baseline``, Swin-T) measured in the same run.
Where mmdet cannot be imported (a GPU host with only torch, timm and mmengine),
the baselines are built from timm's Swin-T and torchvision's ResNet-50 instead,
and the output says so.
Our backbones run once per attention implementation (``--impls``, see
``visattn_mm.ops.impl``); the baselines do not use them (``impl`` is ``-``).

The cases run grid by grid (``--grid``, repeatable: each a set of options that replace the
command line's for that grid), each grid model by model, the baseline first; models are built
once. ``tools/gpu_session.sh`` orders its grids by value: the rows that decide the CUDA defaults
first.

Writes ``<out-dir>/benchmark.csv`` anew after every case (ratios included where the baseline's
row of the same settings exists), so that a run cut off by any means keeps what it measured, and
at the end ``<out-dir>/benchmark.png`` (time and memory against input pixels, log-log, with linear
and quadratic guides; left out with ``--no-plot`` or where matplotlib is missing). Interrupted
(Ctrl-C, ``timeout -s INT``), it still prints the table of the cases measured until then, and
exits with status 1.

Example (short CPU run)::

    .venv/bin/python tools/analysis/benchmark.py --models vil-t,swin-t,r50 \
        --sizes 512x512 --dtypes fp32 --repeats 3 --out-dir work_dirs/benchmark

Compiled blocks (``--compile``): each of our backbones built with ``compile_blocks=True`` and each
block of Swin-T (mmdet's, or timm's) run through the same per-block compiled runner
(:mod:`visattn_mm.models.block_compile`); the rows are named ``<model>+compile`` and their ratios refer
to the compiled Swin-T. The warm-up calls compile (give at least 2: the first size compiles, and the
backward compiles at its first call); compile times are logged, not timed here::

    .venv/bin/python tools/analysis/benchmark.py --compile --models vil-t,swin-t --sizes 224x224 \
        --dtypes fp32 --impls fast --modes fwd+bwd --warmup 2 --repeats 3

CUDA graphs (``--cuda-graphs``, CUDA only): each case's call captured once as a CUDA graph and replayed,
for every model; the rows are named ``<model>+graphs`` and their ratios refer to Swin-T's graphed rows. The
host then launches one graph per call instead of each kernel, which is what a step at small batches waits
for. The first warm-up call captures (give ``--warmup`` at least 1); a case whose step syncs with the host
fails its capture and says so in its status. The memory column of a graphed row is the peak of the captured
call, which the graph's pool keeps between replays::

    .venv/bin/python tools/analysis/benchmark.py --device cuda --cuda-graphs --models vil-s,swin-t \
        --sizes 800x1333 --batches 2 --dtypes bf16 --impls auto --modes fwd+bwd --warmup 2 --repeats 10

Two grids, the second only where time is left (``--grid`` values: ``KEY=VALUE`` words, KEY one
of :data:`GRID_KEYS`)::

    .venv/bin/python tools/analysis/benchmark.py --models vil-t,swin-t --sizes 224x224 --modes fwd+bwd \
        --grid 'batches=8 dtypes=bf16 impls=fast' --grid 'batches=2 dtypes=fp32 impls=fast,math'
"""

from __future__ import annotations

import argparse
import copy
import os.path as osp
import re

import torch
import torch.nn as nn

from visattn_mm.analysis import benchmarking as bench
from visattn_mm.analysis.benchmark_backbones import FUSED, MODEL_ZOO, case_function

DEFAULT_SIZES = ('800x1333', '512x512', '512x2048')
# The options a --grid may replace.
GRID_KEYS = ('models', 'sizes', 'batches', 'dtypes', 'impls', 'modes')
# The settings a ratio compares: the baseline's row with the same ones.
MATCH_KEYS = ('mode', 'dtype', 'batch', 'height', 'width')
COLUMNS = (
    'model',
    'impl',
    'mode',
    'dtype',
    'batch',
    'height',
    'width',
    'megapixels',
    'params_m',
    'time_ms',
    'peak_mem_mib',
    'time_ms_vs_{b}',
    'peak_mem_mib_vs_{b}',
    'status',
)

#: The suffix of compiled models' names (``--compile``).
COMPILED = '+compile'
#: The suffix of the names of models whose calls run as CUDA graphs (``--cuda-graphs``).
GRAPHED = '+graphs'


class CompiledBlock(nn.Module):
    """A baseline's block run through its compiled runner (a wrapper: the benchmark reads no state_dict)."""

    def __init__(self, block, compiler):
        super().__init__()
        self.block = block
        self.compiler = compiler

    def forward(self, *inputs):
        return self.compiler.run(self.block, *inputs)


def compile_baseline_blocks(model, name):
    """Give every block of a baseline (the items of its ``blocks`` lists: mmdet's and timm's Swin) a compiled
    runner, as ``compile_blocks=True`` does for ours; returns ``model``.

    Raises:
        SystemExit: If ``model`` has no ``blocks`` list (ResNet-50: not compiled here).
    """
    from visattn_mm.models.block_compile import BlockCompiler

    compiler = BlockCompiler(name, {})
    blocks = [
        (path.rpartition('.')[0], int(path.rpartition('.')[2]), module)
        for path, module in model.named_modules()
        if re.fullmatch(r'(.+\.)?blocks\.\d+', path)
    ]
    if not blocks:
        raise SystemExit(f'--compile: {name} has no blocks lists to compile; leave it out of --models')
    for parent, index, block in blocks:
        compiler.add(block, f'{parent.replace(".", "_")}_{index}')
        model.get_submodule(parent)[index] = CompiledBlock(block, compiler)
    # the compile-time line our backbones log after each forward pass that compiled
    model.register_forward_hook(lambda module, args, output: compiler.report(args[0].shape[2:]))
    return model


def build_model(name):
    """The model ``name`` of the zoo, with compiled blocks when it ends in :data:`COMPILED` (a graphed
    model, :data:`GRAPHED`, is the model itself)."""
    base = name.removesuffix(GRAPHED).removesuffix(COMPILED)
    builder, uses_ops = MODEL_ZOO[base]
    if name == base:
        return builder()
    return builder(compile_blocks=True) if uses_ops else compile_baseline_blocks(builder(), base)


def run_model(name, grid, device, meter, log, built, measured):
    """All cases of one model in one grid that no earlier grid measured; returns their rows.

    Args:
        name (str): A key of :data:`MODEL_ZOO`.
        grid (argparse.Namespace): The grid's sizes, batches, dtypes, impls and modes, and the run's
            warm-up and repeats.
        device (torch.device): Where it runs.
        meter: The peak-memory meter (``visattn_mm.analysis.benchmarking.memory_meter``).
        log (callable): Called with each row the moment it is measured.
        built (dict): Models built so far, by name (a model is built once per run).
        measured (set): The cases measured so far (skipped here, added to).
    """
    uses_ops = MODEL_ZOO[name.removesuffix(GRAPHED).removesuffix(COMPILED)][1]
    graphed = name.endswith(GRAPHED)
    if name not in built:
        built[name] = build_model(name).to(device)
    model = built[name]
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    impls = grid.impls if uses_ops else [bench.NO_IMPL]
    rows = []
    for height, width in grid.sizes:
        for batch in grid.batches:
            images = torch.randn(batch, 3, height, width, device=device)
            for dtype in grid.dtypes:
                for impl in impls:
                    for mode in grid.modes:
                        case = (name, impl, mode, dtype, batch, height, width)
                        if case in measured:  # e.g. a baseline that an earlier grid timed already
                            continue
                        measured.add(case)
                        row = dict(
                            model=name,
                            impl=impl,
                            mode=mode,
                            dtype=dtype,
                            batch=batch,
                            height=height,
                            width=width,
                            megapixels=height * width / 1e6,
                            params_m=params_m,
                        )
                        fn = case_function(model, images, mode, device, dtype, cache_casts=not graphed)
                        if graphed:
                            fn = bench.CapturedStep(fn, meter)
                        bench.measure_case(row, fn, impl, device, meter, grid)
                        if graphed and row['status'] == 'ok':
                            row['peak_mem_mib'] = fn.capture_peak / bench.MIB
                        del fn  # a graph's pool is freed with it, before the next case
                        log(row)
                        rows.append(row)
            del images
    return rows


def plot_rows(rows, path, title):
    """One colour per (model, impl), one line style per (mode, dtype, batch), over megapixels;
    returns whether the PNG was written (``visattn_mm.analysis.benchmarking.plot_growth``)."""
    series = {}
    for row in rows:
        if row['status'] == 'ok':
            label = (f"{row['model']} {row['impl']}", f"{row['mode']} {row['dtype']} b{row['batch']}")
            series.setdefault(label, []).append((row['megapixels'], row['time_ms'], row['peak_mem_mib']))
    return bench.plot_growth(series, 'input megapixels', path, title)


def columns_for(baseline):
    return [c.format(b=baseline) for c in COLUMNS]


def check_grid(grid):
    """Parses and checks the options of one grid (:data:`GRID_KEYS`, as text) in place; the baseline
    joins its models first where they lack it.

    Raises:
        SystemExit: naming the option that cannot work.
    """
    grid.models = (
        [name for name in MODEL_ZOO if not name.endswith(FUSED)]
        if grid.models == 'all'
        else bench.check_choices(bench.parse_list(grid.models), MODEL_ZOO, '--models')
    )
    if grid.compile:
        if 'r50' in grid.models:
            raise SystemExit('--compile: r50 has no compiled variant here; leave it out of --models')
        grid.models = [name + COMPILED for name in grid.models]
    if grid.cuda_graphs:
        grid.models = [name + GRAPHED for name in grid.models]
    if grid.baseline not in grid.models:
        grid.models.insert(0, grid.baseline)
    grid.sizes = [bench.parse_size(s, '--sizes') for s in bench.parse_list(grid.sizes)]
    grid.batches = bench.parse_list(grid.batches, int, '--batches')
    if min(grid.batches) < 1:
        raise SystemExit(f'--batches: batch sizes must be >= 1, got {grid.batches}')
    bench.check_run_options(grid)
    return grid


def grid_from(text, args):
    """The grid ``--grid text`` describes: the command line's options, with the ``KEY=VALUE`` words of
    ``text`` in place of theirs."""
    grid = copy.copy(args)
    for word in text.split():
        key, equals, value = word.partition('=')
        if not equals or key not in GRID_KEYS:
            raise SystemExit(f'--grid: {word!r} is not KEY=VALUE with KEY one of {", ".join(GRID_KEYS)}')
        setattr(grid, key, value)
    return check_grid(grid)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', default='all', help=f'comma-separated, or "all": {", ".join(MODEL_ZOO)}')
    parser.add_argument('--baseline', default='swin-t', help='model the ratios refer to (measured first)')
    parser.add_argument('--sizes', default=','.join(DEFAULT_SIZES), help='HEIGHTxWIDTH list')
    parser.add_argument('--batches', default='1,2', help='comma-separated batch sizes (ints >= 1), e.g. 1,2,8')
    parser.add_argument('--dtypes', default='fp32,bf16', help='fp32, bf16, fp16 (the last two under autocast)')
    parser.add_argument(
        '--impls',
        default='math,fast',
        help='attention implementations of our backbones: math, fast, auto, triton (CUDA)',
    )
    parser.add_argument(
        '--modes',
        default=','.join(bench.MODES),
        help=f'comma-separated, any of: {", ".join(bench.MODES)} (forward; forward + backward)',
    )
    parser.add_argument(
        '--grid',
        action='append',
        default=[],
        help=f'repeatable: one grid of cases, KEY=VALUE words (KEY: {", ".join(GRID_KEYS)}) replacing the options '
        'above for that grid; the grids run in the order given (default: one grid of the options above)',
    )
    parser.add_argument(
        '--warmup', type=int, default=1, help='untimed calls before the timed ones, an int >= 0 (default: %(default)s)'
    )
    parser.add_argument(
        '--repeats', type=int, default=3, help='timed calls, an int >= 1; the median is reported (default: %(default)s)'
    )
    parser.add_argument(
        '--compile',
        action='store_true',
        help='compile each block of every model (ours: compile_blocks=True; Swin-T: its blocks the same way); '
        'rows named MODEL+compile, ratios to swin-t+compile; r50 is not compiled',
    )
    parser.add_argument(
        '--cuda-graphs',
        action='store_true',
        help='run each call as a captured CUDA graph (--device cuda, --warmup >= 1); rows named MODEL+graphs, '
        'ratios to swin-t+graphs',
    )
    parser.add_argument('--device', default='cpu', help='cpu, cuda or cuda:N')
    parser.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    parser.add_argument('--out-dir', default='work_dirs/benchmark')
    parser.add_argument('--no-plot', action='store_true', help='write no benchmark.png')
    args = parser.parse_args(argv)
    if args.baseline not in MODEL_ZOO:
        raise SystemExit(f'--baseline: unknown model {args.baseline!r}')
    if args.cuda_graphs:
        if args.compile:
            raise SystemExit('--cuda-graphs and --compile: choose one (compiled blocks are not captured here)')
        if not args.device.startswith('cuda'):
            raise SystemExit(f'--cuda-graphs: CUDA graphs need --device cuda, not {args.device!r}')
        if args.warmup < 1:
            raise SystemExit('--cuda-graphs: give --warmup 1 or more (the first call captures the graph)')
    if args.compile:
        args.baseline += COMPILED
    if args.cuda_graphs:
        args.baseline += GRAPHED
    args.grids = [grid_from(text, args) for text in args.grid or ['']]
    return args


def main(argv=None):
    args = parse_args(argv)
    device, meter, machine = bench.start_run(args)
    columns = columns_for(args.baseline)
    csv_path = osp.join(args.out_dir, 'benchmark.csv')
    png_path = osp.join(args.out_dir, 'benchmark.png')
    rows = []

    def log(row):
        print(
            f"{row['model']:>9} {row['impl']:>6} {row['mode']:>7} {row['dtype']:>4} "
            f"b{row['batch']} {row['height']}x{row['width']}: "
            f"{bench.format_value(row.get('time_ms'))} ms, "
            f"{bench.format_value(row.get('peak_mem_mib'))} MiB {row['status']}",
            flush=True,
        )
        rows.append(row)
        bench.add_ratio_columns(rows, args.baseline, MATCH_KEYS, ('time_ms', 'peak_mem_mib'))
        bench.write_csv(rows, columns, csv_path)

    built, measured = {}, set()
    with bench.UntilInterrupted('benchmark', lambda: f'the {len(rows)} rows') as run:
        for grid in args.grids:
            for name in grid.models:
                run_model(name, grid, device, meter, log, built, measured)
    bench.add_ratio_columns(rows, args.baseline, MATCH_KEYS, ('time_ms', 'peak_mem_mib'))
    print(f'\n{machine}; {device.type}; median of {args.repeats} after {args.warmup} warm-up\n')
    print(bench.format_table(rows, columns))
    bench.write_csv(rows, columns, csv_path)
    plotted = not args.no_plot and plot_rows(rows, png_path, f'backbone benchmark ({device.type}): {machine}')
    print(f'\nwrote {csv_path}' + (f' and {png_path}' if plotted else ''))
    run.exit_if_interrupted()
    return rows


if __name__ == '__main__':
    main()
