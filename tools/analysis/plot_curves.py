"""Plot training curves (loss, learning rate, AP / mIoU) from a work directory.

Usage::

    python tools/analysis/plot_curves.py WORK_DIR [--keys loss lr coco/bbox_mAP]
        [--out curves.png]

Reads the scalars mmengine's ``LocalVisBackend`` writes, one JSON object per
line, in ``WORK_DIR/<timestamp>/vis_data/scalars.json``: training lines carry
``loss``, ``lr``, ... with ``iter`` and ``step``; validation lines carry the
metrics (``coco/bbox_mAP``, ``mIoU``, ...) with ``step``. Every run under the
work directory is read in timestamp order, so a resumed training shows as one
curve; where runs overlap, the later run's value for a step wins. WORK_DIR may
also be one run's directory or a ``scalars.json`` file.

Each key gets its own panel, plotted against ``step`` (iterations, or epochs
for epoch-based validation). The reading and drawing live in ``visattn_mm.analysis.training_curves``.
"""

from __future__ import annotations

import argparse
import os.path as osp
from pathlib import Path

from visattn_mm.analysis.training_curves import DEFAULT_KEYS, find_scalar_files, plot, read_series, select_keys


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description='Plot mmengine training curves')
    parser.add_argument('work_dir', help='work dir, one run dir, or a scalars.json')
    parser.add_argument(
        '--keys', nargs='+', help=f'scalars to plot (default: those of {", ".join(DEFAULT_KEYS)} that were logged)'
    )
    parser.add_argument('--out', default='curves.png', help='output image (.png)')
    args = parser.parse_args(argv)
    try:
        files = find_scalar_files(args.work_dir)
        series, validation_keys = read_series(files)
        keys = select_keys(series, args.keys)
    except (FileNotFoundError, KeyError) as err:
        raise SystemExit(str(err).strip('"')) from None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    plot(series, keys, args.out, title=osp.basename(osp.abspath(args.work_dir)), validation_keys=validation_keys)
    print(f'{", ".join(f"{k} ({len(series[k])} points)" for k in keys)} -> {args.out}')


if __name__ == '__main__':
    main()
