"""Measure parameters and FLOPs of the detection / segmentation configs; write the model zoo.

Usage::

    python tools/analysis/model_zoo.py [--tasks maskrcnn retinanet upernet]
        [--configs maskrcnn_vil_t_1x ...] [--skip-flops] [--device cpu]
        [--out docs/model_zoo.md]

Configs are found by name in ``configs/``: ``maskrcnn_<backbone>_<size>_{1x,3x_ms}.py``,
``retinanet_<backbone>_<size>_{1x,3x_ms}.py`` and
``upernet_<backbone>_<size>_160k_ade20k.py``. Every config of the planned matrix
gets a row; one that does not exist yet is listed as missing, and a config file
of one of these tasks outside the matrix is reported and skipped. 1x and 3x + MS
configs that build the same model are measured once. ``--device cuda`` runs
the counted forward passes on a GPU (same counts, much faster).

The counting is ``visattn_mm.analysis.flops``, the papers' numbers and the planned matrix
``visattn_mm.analysis.paper_numbers``, the page's text ``visattn_mm.analysis.model_zoo_page``.

A run of every task without ``--configs`` or ``--skip-flops`` writes ``--out``
afresh. A partial run updates an existing page instead: it replaces the rows it
measured (keeping their FLOPs cells under ``--skip-flops``) and keeps every
other row and table as it was.

What is counted (mmdet's / mmseg's ``get_flops.py`` convention):

* Parameters: every parameter of the built model, ``sum(p.numel())``, auxiliary
  heads included, no classification head.
* FLOPs: multiply-adds of convolutions and matrix products, counted by
  ``torch.utils.flop_counter.FlopCounterMode`` at the ATen level, so every
  matmul, ``einsum``, ``bmm``, ``linear``, convolution and
  ``scaled_dot_product_attention`` inside the attention ops is seen whatever
  Python code issues it (the CPU flash-attention kernel, which torch's counter
  skips, gets a handle here). Softmax, normalisation, activations, element-wise
  arithmetic, RoIAlign, NMS and interpolation are not counted.
* The forward pass is each library's ``mode='tensor'`` forward, as mmdet's and
  mmseg's ``get_flops.py`` use: backbone + neck + heads for RetinaNet;
  backbone + neck + RPN + box head on the RPN's proposals (at most 1000) + mask
  head on the first 100 for Mask R-CNN; backbone + decode head (no auxiliary
  head) for UperNet. The input is one random image tensor of the stated size,
  not padded (the backbones pad internally); the seed is fixed, so the RPN's
  proposal count, and with it the RoI heads' FLOPs, is reproducible.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from visattn_mm.analysis.flops import Measurement, measure, model_key
from visattn_mm.analysis.model_zoo_page import read_page, render
from visattn_mm.analysis.paper_numbers import TASK_SCHEDULES, flops_input, planned_configs

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / 'configs'


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument(
        '--tasks', nargs='+', choices=list(TASK_SCHEDULES), default=list(TASK_SCHEDULES), help='tables to build'
    )
    parser.add_argument(
        '--configs',
        nargs='+',
        metavar='STEM',
        help='measure only these configs (file names without .py); '
        'other rows keep their cells from an existing --out page, '
        'else stay empty',
    )
    parser.add_argument(
        '--skip-flops', action='store_true', help='count parameters only (seconds per config instead of minutes)'
    )
    parser.add_argument(
        '--device',
        default='cpu',
        help="where to run the counted forward passes, e.g. 'cuda' (same counts, much faster)",
    )
    parser.add_argument(
        '--out',
        default=str(ROOT / 'docs' / 'model_zoo.md'),
        help='markdown file to write; a partial run (--tasks, --configs, '
        '--skip-flops) merges its rows into an existing page',
    )
    args = parser.parse_args(argv)

    rows = planned_configs(args.tasks)
    known = {stem for stem, *_ in rows}
    unknown = sorted(set(args.configs or ()) - known)
    if unknown:
        raise SystemExit(
            f'--configs {unknown} are not in the planned matrix of '
            f'--tasks {args.tasks}; names look like maskrcnn_vil_t_1x'
        )
    out = Path(args.out)
    complete = set(args.tasks) == set(TASK_SCHEDULES) and not args.configs and not args.skip_flops
    previous_page = None
    if not complete and out.is_file():
        # A partial run updates the page instead of replacing it: the rows and
        # cells it did not measure took up to 20 minutes to make.
        previous_page = out.read_text()
        if not read_page(previous_page)[1]:
            raise SystemExit(
                f'{out} exists and has no model-zoo table rows; this partial run '
                '(--tasks, --configs or --skip-flops) would only merge into a '
                'model-zoo page: pass a new --out file'
            )
    for task in args.tasks:
        for path in sorted(CONFIG_DIR.glob(f'{task}_*.py')):
            if path.stem not in known:
                print(f'{path.name}: not in the planned matrix, skipped', flush=True)
    measurements: dict[str, Measurement] = {}
    by_model: dict[tuple, Measurement] = {}
    for stem, task, backbone, *_ in rows:
        path = CONFIG_DIR / f'{stem}.py'
        if args.configs and stem not in args.configs:
            continue
        if not path.is_file():
            print(f'{stem}: no config yet, left empty', flush=True)
            continue
        size = flops_input(stem, task, backbone)
        key = (model_key(path), size)
        if key in by_model:
            measurements[stem] = by_model[key]
            print(f'{stem}: same model as an earlier config, reused', flush=True)
            continue
        found = measure(path, args.skip_flops, size, args.device)
        measurements[stem] = by_model[key] = found
        flops = '' if found.flops is None else (f', {found.flops / 1e9:.1f} GMACs at {found.flops_input}')
        print(f'{stem}: {found.params / 1e6:.2f}M params{flops} ({found.seconds:.0f} s)', flush=True)
    command = 'python tools/analysis/model_zoo.py ' + ' '.join(argv if argv is not None else sys.argv[1:])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(args.tasks, measurements, command.strip(), previous_page, config_dir=CONFIG_DIR))
    if previous_page is None:
        print(f'wrote {out}' + ('' if complete else ' (a partial page: only what this run measured)'))
    else:
        print(
            f'updated {out}: {len(measurements)} measured rows replaced'
            f'{" (their FLOPs cells kept)" if args.skip_flops else ""}; '
            'every other row and table kept as it was'
        )


if __name__ == '__main__':
    main()
