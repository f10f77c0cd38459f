"""Training curves (loss, learning rate, AP / mIoU) from the scalars mmengine's ``LocalVisBackend`` writes:
reading them and drawing them, for ``tools/analysis/plot_curves.py`` and the demo (``tools/run_demo.py``).

The file is one JSON object per line, ``<work dir>/<timestamp>/vis_data/scalars.json``: training lines carry
``loss``, ``lr``, ... with ``iter`` and ``step``; validation lines carry the metrics (``coco/bbox_mAP``,
``mIoU``, ...) with ``step``.
"""

from __future__ import annotations

import json
from pathlib import Path

# Plotted when present and no --keys are given.
DEFAULT_KEYS = ('loss', 'lr', 'coco/bbox_mAP', 'coco/segm_mAP', 'mIoU')


def find_scalar_files(path: str | Path) -> list[Path]:
    """The ``scalars.json`` files of every run under ``path``, oldest first.

    Raises:
        FileNotFoundError: If ``path`` holds no scalars file.
    """
    path = Path(path)
    if path.is_file():
        return [path]
    files = sorted(path.glob('vis_data/scalars.json')) + sorted(
        path.glob('*/vis_data/scalars.json')
    )  # timestamps sort chronologically
    if not files:
        raise FileNotFoundError(
            f'no vis_data/scalars.json under {path}: pass an mmengine work dir whose '
            "runs used LocalVisBackend (mmdet's and mmseg's default visualizer does)"
        )
    return files


def read_series(files: list[Path]) -> tuple[dict[str, dict[float, float]], frozenset]:
    """Every numeric scalar in ``files`` as ``{key: {step: value}}``.

    Lines without ``step`` are skipped; later files override earlier ones at
    the same step.

    Returns:
        The series, and the keys logged by validation (lines without ``iter``).
    """
    series: dict[str, dict[float, float]] = {}
    validation_keys = set()
    for file in files:
        for line in file.read_text().splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            step = record.get('step')
            if step is None:
                continue
            for key, value in record.items():
                if key in ('step', 'iter', 'epoch') or not isinstance(value, (int, float)):
                    continue
                series.setdefault(key, {})[step] = float(value)
                if 'iter' not in record:
                    validation_keys.add(key)
    return series, frozenset(validation_keys)


def select_keys(series: dict, keys: list[str] | None) -> list[str]:
    """The keys to plot: ``keys`` if given (all must exist), else the defaults present.

    Raises:
        KeyError: If a requested key is absent, naming the keys that exist.
    """
    if keys is None:
        chosen = [k for k in DEFAULT_KEYS if k in series]
        return chosen or sorted(series)
    missing = [k for k in keys if k not in series]
    if missing:
        raise KeyError(f'{missing} not in the logged scalars; available: {sorted(series)}')
    return list(keys)


def draw_panel(ax, series: dict, key: str, validation_keys: frozenset = frozenset()) -> None:
    """Draw one key's values against step into the matplotlib axes ``ax``."""
    steps = sorted(series[key])
    values = [series[key][s] for s in steps]
    ax.plot(steps, values, marker='o' if len(steps) < 30 else None, markersize=3)
    ax.set_ylabel(key)
    ax.set_xlabel('validation step (epoch or iteration)' if key in validation_keys else 'iteration')
    ax.grid(alpha=0.3)


def plot(
    series: dict, keys: list[str], out: str | Path, title: str = '', validation_keys: frozenset = frozenset()
) -> None:
    """Write one panel per key, value against step, to the image file ``out``.

    Keys in ``validation_keys`` get the x label of validation steps, which
    LoggerHook logs by epoch unless ``log_metric_by_epoch=False``.
    """
    import matplotlib

    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.4 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        draw_panel(ax, series, key, validation_keys)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
