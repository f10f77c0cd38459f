"""onnxruntime (CPU) vs eager PyTorch (CPU) latency of each backbone family, in one run.

Usage::

    python tools/deploy/latency.py [--size 800 1333] [--arch tiny] [--repeats 5] [--out FILE.csv]

Each backbone (random weights, ``attn_impl='fast'``, eval, no gradients) is exported at
``--size`` (batch 1) to ONNX, checked against eager (largest relative difference), then
both are timed alternately, ``--repeats`` times after one warm-up call each; the median
of each and their ratio (onnxruntime / eager) are printed as a Markdown table and
written to ``--out``. Both use every thread the process may use.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import tempfile
import time
from pathlib import Path

from visattn_mm import cli as common
from visattn_mm.models import BACKBONES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='onnxruntime vs eager CPU latency per backbone family')
    parser.add_argument('--size', type=int, nargs=2, default=(800, 1333), metavar=('H', 'W'))
    parser.add_argument('--arch', default='tiny')
    parser.add_argument('--families', nargs='+', default=tuple(BACKBONES), choices=tuple(BACKBONES))
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--out', help='CSV file for the table')
    return parser.parse_args(argv)


def seconds(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(family, args, workdir):
    """One row of the table: the family's eager and onnxruntime medians, their ratio, the difference."""
    import torch
    from mmdet.registry import MODELS

    from visattn_mm import deploy

    model = MODELS.build(dict(type=family, arch=args.arch, attn_impl='fast')).eval()
    images = torch.randn(1, 3, *args.size)
    path = Path(workdir) / f'{family}.onnx'
    deploy.export_onnx(deploy.export_program(model, images, dynamic_shapes=False), path)
    session = deploy.onnx_session(path)
    with torch.no_grad():
        expected = model(images)
        error = deploy.max_relative_error(deploy.run_onnx(session, images), expected)
        eager, runtime = [], []
        for _ in range(args.repeats):
            eager.append(seconds(lambda: model(images)))
            runtime.append(seconds(lambda: deploy.run_onnx(session, images)))
    eager_s, runtime_s = statistics.median(eager), statistics.median(runtime)
    return dict(
        backbone=f'{family} {args.arch}',
        eager_s=round(eager_s, 3),
        onnxruntime_s=round(runtime_s, 3),
        ratio=round(runtime_s / eager_s, 2),
        max_relative_error=f'{error:.1e}',
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    common.import_plugin()
    import torch

    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for family in args.families:
            try:
                rows.append(measure(family, args, workdir))
            except Exception as error:  # noqa: BLE001 -- one family's failure is a row, not the end of the run
                rows.append(
                    dict(
                        backbone=f'{family} {args.arch}',
                        eager_s='',
                        onnxruntime_s='',
                        ratio='',
                        max_relative_error=f'export failed: {type(error).__name__}',
                    )
                )
            print(rows[-1], flush=True)
    print(
        f'\n{args.size[0]}x{args.size[1]}, batch 1, CPU threads: torch {torch.get_num_threads()}, '
        f'median of {args.repeats}\n'
    )
    print('| backbone | eager PyTorch (s) | onnxruntime (s) | onnxruntime / eager | max rel. diff |')
    print('|---|---|---|---|---|')
    for row in rows:
        print(
            f"| {row['backbone']} | {row['eager_s']} | {row['onnxruntime_s']} | {row['ratio']} | "
            f"{row['max_relative_error']} |"
        )
    if args.out:
        with open(args.out, 'w', newline='') as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == '__main__':
    sys.exit(main())
