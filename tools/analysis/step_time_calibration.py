"""The step-time estimate calibrated on the device calls' measured rows, with its error on held-out calls.

Every ``benchmark.csv`` of a device call (:data:`CALL_DIRS`; the GPU kind read from the call's
``session.log``) gives measured steps; each is traced on the CPU as today's tree runs it
(``visattn_mm.analysis.step_cost``, cached per case in ``--trace-cache``: delete it after a change
to the code), priced by ``visattn_mm.analysis.step_time``'s terms, and the costs are fitted per GPU
kind on the rows of every call but the held-out ones (``--held-out``). The table printed is the
estimate against the measurement on the held-out rows, which the fit never saw.

The measurements are of the trees named in docs/benchmarks.md (commits of 2026-11-26); the traces
are of today's tree: where a change since altered a step, that row's error holds it too.

Example (the section "Estimated step time (CPU)" of docs/benchmarks.md)::

    .venv/bin/python tools/analysis/step_time_calibration.py --write
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import os.path as osp
import re
import subprocess
import time

import numpy as np

from visattn_mm.analysis import benchmarking as bench
from visattn_mm.analysis import step_time

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
# The device calls' folders, where they are kept (docs/ now, a top-level results/ folder later).
CALL_DIRS = ('docs/gpu_*/call*', 'results/gpu_*/call*')
# The later call of each GPU kind's session: held out of the fit by default.
DEFAULT_HELD_OUT = ('gpu_2026-11-26/call2', 'gpu_2026-11-27/call1')
RATES_MODULE = osp.join(ROOT, 'visattn_mm', 'analysis', 'step_time_rates.py')
CASE_KEYS = ('model', 'impl', 'dtype', 'batch', 'height', 'width', 'mode')
TRACED_AS = {'fp16': 'bf16'}
TABLE_COLUMNS = ('gpu', 'call', 'model', 'impl', 'dtype', 'batch', 'est_ms', 'measured_ms', 'error')


def call_name(folder):
    """``gpu_<date>/call<n>``: a call's name wherever its folder is kept."""
    return '/'.join(osp.normpath(folder).split(os.sep)[-2:])


def gpu_kind(folder):
    """The GPU a call ran on ('H100', 'H200', ...) from its ``session.log``, or None."""
    log = osp.join(folder, 'session.log')
    if not osp.exists(log):
        return None
    with open(log, errors='replace') as text:
        found = re.search(r'NVIDIA (H\d+)', text.read())
    return found.group(1) if found else None


def measured_rows(models, modes=('fwd+bwd',), root=ROOT):
    """The measured rows (status ok, a time) of every call under :data:`CALL_DIRS` for ``models`` and ``modes``.

    Returns:
        list[dict]: ``gpu``, ``call``, the :data:`CASE_KEYS` and ``measured_ms``.
    """
    rows = []
    folders = sorted({folder for pattern in CALL_DIRS for folder in glob.glob(osp.join(root, pattern))})
    for folder in folders:
        table, kind = osp.join(folder, 'benchmark.csv'), gpu_kind(folder)
        if not osp.exists(table) or kind is None:
            continue
        for line in bench.read_csv(table):
            if line['status'] != 'ok' or not line['time_ms'] or line['model'] not in models:
                continue
            if line['mode'] not in modes:
                continue
            rows.append(
                dict(
                    gpu=kind,
                    call=call_name(folder),
                    model=line['model'],
                    impl=line['impl'],
                    dtype=line['dtype'],
                    batch=int(line['batch']),
                    height=int(line['height']),
                    width=int(line['width']),
                    mode=line['mode'],
                    measured_ms=float(line['time_ms']),
                )
            )
    return rows


def traced_case(row):
    """The case a row is traced as: fp16 autocast as bf16, the same program (same sizes, the same
    CUDA autocast lists; the counts of six such pairs were identical), so each is traced once."""
    return tuple(TRACED_AS.get(row[key], row[key]) if key == 'dtype' else row[key] for key in CASE_KEYS)


def trace_terms(rows, cache_dir):
    """Adds ``terms`` (:func:`step_time.step_terms`) to each row, tracing each distinct case once."""
    import torch

    from visattn_mm.analysis.benchmark_backbones import build_backbone
    from visattn_mm.analysis.step_cost import trace_step
    from visattn_mm.ops.impl import attention_impl

    os.makedirs(cache_dir, exist_ok=True)
    cases = sorted({traced_case(row) for row in rows})
    terms, models = {}, {}
    for case in cases:
        model_name, impl, dtype, batch, height, width, mode = case
        path = osp.join(cache_dir, '_'.join(str(part) for part in case).replace('+', 'p') + '.json')
        if osp.exists(path):
            with open(path) as cached:
                terms[case] = json.load(cached)
            continue
        begin = time.perf_counter()
        torch.manual_seed(0)
        model = models.get(model_name) or models.setdefault(model_name, build_backbone(model_name))
        model.train()
        with attention_impl(impl if impl != bench.NO_IMPL else 'auto'):
            cost = trace_step(model, (batch, 3, height, width), dtype=dtype, mode=mode, device_type='cuda')
        terms[case] = step_time.step_terms(cost, dtype)
        with open(path + '.part', 'w') as out:
            json.dump(terms[case], out, indent=1, sort_keys=True)
        os.replace(path + '.part', path)
        print(f'traced {" ".join(map(str, case))} in {time.perf_counter() - begin:.0f} s', flush=True)
    for row in rows:
        row['terms'] = terms[traced_case(row)]
    return rows


def calibrate(rows, held_out):
    """Fits the costs per GPU kind on the rows of calls not in ``held_out`` and estimates every row.

    Args:
        rows (list[dict]): :func:`measured_rows` with ``terms``.
        held_out (Iterable[str]): Call names (:func:`call_name`) whose rows the fit must not see.

    Returns:
        tuple: ``(costs, fitted_on, rows)``: ``{gpu: {term: ms per unit}}``, ``{gpu: sorted call names}``,
        and the rows with ``est_ms``, ``error`` (relative) and ``held_out`` (bool) added.
    """
    held_out = set(held_out)
    costs, fitted_on = {}, {}
    for kind in sorted({row['gpu'] for row in rows}):
        fit_rows = [row for row in rows if row['gpu'] == kind and row['call'] not in held_out]
        if not fit_rows:
            continue
        costs[kind] = step_time.fit_costs([row['terms'] for row in fit_rows], [row['measured_ms'] for row in fit_rows])
        fitted_on[kind] = sorted({row['call'] for row in fit_rows})
    for row in rows:
        row['held_out'] = row['call'] in held_out
        try:
            row['est_ms'] = step_time.estimate_ms(row['terms'], costs[row['gpu']])
        except KeyError:  # a kind with no fitted call, or a term no fitted row had
            row['est_ms'] = None
        row['error'] = None if row['est_ms'] is None else row['est_ms'] / row['measured_ms'] - 1
    return costs, fitted_on, rows


def _number(value):
    return repr(float(f'{value:.4g}'))


def write_rates_module(costs, fitted_on, row_counts, path=RATES_MODULE):
    """Writes the fitted costs as :mod:`visattn_mm.analysis.step_time_rates` (formatted as ruff would)."""
    commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True)
    lines = [
        '"""Costs of the step-time estimate (:mod:`visattn_mm.analysis.step_time`) per GPU kind, ms per unit.',
        '',
        'Written by ``tools/analysis/step_time_calibration.py --write``: rerun it rather than edit this file.',
        '"""',
        '',
        f'FITTED_AT = {commit.stdout.strip() or "unknown"!r}  # the tree traced',
        'FITTED_ON = {',
    ]
    for kind, calls in fitted_on.items():
        lines.append(f'    {kind!r}: ({", ".join(repr(call) for call in calls)},),')
    lines += ['}', 'FITTED_ROWS = {']
    lines += [f'    {kind!r}: {count},' for kind, count in row_counts.items()]
    lines += ['}', 'COSTS = {']
    for kind, kind_costs in costs.items():
        lines.append(f'    {kind!r}: {{')
        lines += [f'        {term!r}: {_number(cost)},' for term, cost in sorted(kind_costs.items())]
        lines.append('    },')
    lines.append('}')
    with open(path, 'w') as out:
        out.write('\n'.join(lines) + '\n')


def cost_table(costs):
    """Markdown table of the fitted costs, as rates, one column per GPU kind."""
    kinds = sorted(costs)
    terms = sorted({term for kind_costs in costs.values() for term in kind_costs})
    rows = [
        dict(term=term, **{kind: step_time.effective_rate(term, costs[kind].get(term, 0.0)) for kind in kinds})
        for term in terms
    ]
    return bench.format_table(rows, ('term', *kinds))


def compact_table(rows):
    """The held-out rows as one line per GPU kind, call, model and path, one column per dtype and batch:
    ``estimate / measured ms (error)``."""
    held = [row for row in rows if row['held_out']]
    settings = sorted({(row['dtype'], row['batch']) for row in held}, key=lambda s: (s[0], -s[1]))
    columns = [f'{dtype} b{batch}' for dtype, batch in settings]
    lines = {}
    for row in held:
        line = lines.setdefault(
            (row['gpu'], row['call'], row['model'], row['impl']),
            dict(gpu=row['gpu'], call=row['call'], model=row['model'], impl=row['impl']),
        )
        estimate = '-' if row['est_ms'] is None else f"{row['est_ms']:.0f}"
        error = '' if row['error'] is None else f" ({row['error']:+.0%})"
        line[f"{row['dtype']} b{row['batch']}"] = f"{estimate} / {row['measured_ms']:.0f}{error}"
    return bench.format_table(list(lines.values()), ('gpu', 'call', 'model', 'impl', *columns))


def error_summary(rows):
    """One line per GPU kind and side (fit, held out): rows, median and largest |error|."""
    lines = []
    for kind in sorted({row['gpu'] for row in rows}):
        for held in (False, True):
            side = [row for row in rows if row['gpu'] == kind and row['held_out'] == held]
            errors = [abs(row['error']) for row in side if row['error'] is not None]
            if errors:
                lines.append(
                    f'{kind} {"held out" if held else "fit":>8}: {len(errors)} rows, median |error| '
                    f'{np.median(errors):.1%}, largest {max(errors):.1%}'
                )
    return '\n'.join(lines)


def parse_args(argv=None):
    from visattn_mm.analysis.benchmark_backbones import MODEL_ZOO

    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument(
        '--held-out',
        default=','.join(DEFAULT_HELD_OUT),
        help='comma-separated calls (gpu_<date>/call<n>) left out of the fit; the table shows their rows',
    )
    parser.add_argument(
        '--models', default='all', help='comma-separated models whose rows are used (benchmark.py names), or "all"'
    )
    parser.add_argument('--modes', default='fwd+bwd', help='comma-separated: fwd+bwd, fwd')
    parser.add_argument('--trace-cache', default='work_dirs/step_time/traces', help='cached traces, one per case')
    parser.add_argument('--write', action='store_true', help=f'write the fitted costs to {osp.relpath(RATES_MODULE)}')
    parser.add_argument('--all-rows', action='store_true', help='print the fitted rows too (in-sample error)')
    args = parser.parse_args(argv)
    args.held_out = bench.parse_list(args.held_out, option='--held-out')
    args.modes = bench.check_choices(bench.parse_list(args.modes, option='--modes'), bench.MODES, '--modes')
    known = tuple(MODEL_ZOO)
    chosen = known if args.models == 'all' else bench.parse_list(args.models, option='--models')
    args.models = tuple(bench.check_choices(chosen, known, '--models'))
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = measured_rows(args.models, tuple(args.modes))
    calls = {row['call'] for row in rows}
    unknown = sorted(set(args.held_out) - calls)
    if unknown:
        raise SystemExit(f'--held-out: no measured rows in {", ".join(unknown)}; calls: {", ".join(sorted(calls))}')
    costs, fitted_on, rows = calibrate(trace_terms(rows, args.trace_cache), args.held_out)
    shown = [
        dict(row, error=None if row['error'] is None else f"{row['error']:+.0%}")
        for row in rows
        if row['held_out'] or args.all_rows
    ]
    print('\nEstimated step time (an estimate from CPU-traced counts) against the measured time, held-out rows:\n')
    print(bench.format_table(shown, TABLE_COLUMNS))
    print('\nThe same, one line per model and path (estimate / measured ms (error)):\n')
    print(compact_table(rows))
    print('\n' + error_summary(rows))
    fits = '; '.join(f'{kind}: {", ".join(calls)}' for kind, calls in fitted_on.items())
    print(f'\nFitted costs as effective rates (fit on {fits}):\n\n' + cost_table(costs))
    if args.write:
        counts = {kind: sum(r['gpu'] == kind and not r['held_out'] for r in rows) for kind in fitted_on}
        write_rates_module(costs, fitted_on, counts)
        print(f'\nwrote {osp.relpath(RATES_MODULE)}')
    return costs, rows


if __name__ == '__main__':
    main()
