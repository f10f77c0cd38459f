"""The model zoo's planned config matrix and the papers' numbers it is checked against
(``tools/analysis/model_zoo.py`` writes ``docs/model_zoo.md`` from them).

Every number in :data:`PAPER` is the paper's (the row's ``source``), never ours;
:func:`is_flagged` marks a measurement more than :data:`TOLERANCE` away from it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Backbone names as they appear in config file names, with their sizes.
BACKBONE_SIZES = {
    'vil': ('t', 's', 'm', 'b'),
    'vil_ls': ('t', 's', 'm', 'b'),
    'pale': ('t', 's', 'b'),
    'vvt': ('t', 's', 'm', 'l'),
}
BACKBONE_TITLES = {'vil': 'ViL', 'vil_ls': 'ViL-LS', 'pale': 'Pale', 'vvt': 'VVT'}
TASK_SCHEDULES = {
    'maskrcnn': ('1x', '3x_ms'),
    'retinanet': ('1x', '3x_ms'),
    'upernet': ('160k_ade20k',),
}
TASK_TITLES = {'maskrcnn': 'Mask R-CNN (COCO)', 'retinanet': 'RetinaNet (COCO)', 'upernet': 'UperNet (ADE20K)'}
SCHEDULE_TITLES = {'1x': '1x', '3x_ms': '3x + MS', '160k_ade20k': '160k'}
# FLOPs input (H, W) where no paper number fixes it: mmdet's get_flops default
# (1280x800) and the ADE20K training crop.
DEFAULT_INPUT = {'maskrcnn': (800, 1280), 'retinanet': (800, 1280), 'upernet': (512, 512)}
# Relative difference from the paper above which a row is flagged.
TOLERANCE = 0.02

VIL_T6 = 'ViL paper, Table 6 (RetinaNet, FLOPs at 800x1333)'
VIL_T7 = 'ViL paper, Table 7 (Mask R-CNN, FLOPs at 800x1333)'
PALE_T3 = 'Pale paper, Table 3 (Mask R-CNN 1x, FLOPs at 1280x800)'
PALE_T4 = 'Pale paper, Table 4 (UperNet 160k, FLOPs at 512x2048, single-scale mIoU)'
VVT_T5 = 'VVT paper, Table 5 (UperNet, Swin setting; FLOPs at 512x512, see the notes)'


@dataclass(frozen=True)
class PaperRow:
    """Numbers a paper reports for one config; ``None`` where it reports none."""

    params_m: float | None
    gflops: float | None
    flops_input: tuple[int, int] | None  # (H, W) the paper's FLOPs are measured at
    metric: str  # AP box / mask, AP, or mIoU
    source: str


VIL_DET = (800, 1333)
PAPER = {
    'maskrcnn_vil_t_1x': PaperRow(26.9, 145.6, VIL_DET, '41.4 / 38.1', VIL_T7),
    'maskrcnn_vil_s_1x': PaperRow(45.0, 218.3, VIL_DET, '44.9 / 41.0', VIL_T7),
    'maskrcnn_vil_m_1x': PaperRow(60.1, 293.8, VIL_DET, '47.6 / 43.0 (IN-21k)', VIL_T7),
    'maskrcnn_vil_b_1x': PaperRow(76.1, 384.4, VIL_DET, '48.6 / 43.6 (IN-21k)', VIL_T7),
    'maskrcnn_vil_t_3x_ms': PaperRow(26.9, 145.6, VIL_DET, '44.2 / 40.6', VIL_T7),
    'maskrcnn_vil_s_3x_ms': PaperRow(45.0, 218.3, VIL_DET, '47.1 / 42.7', VIL_T7),
    'maskrcnn_vil_m_3x_ms': PaperRow(60.1, 293.8, VIL_DET, '48.9 / 44.2 (IN-21k)', VIL_T7),
    'maskrcnn_vil_b_3x_ms': PaperRow(76.1, 384.4, VIL_DET, '49.6 / 44.5 (IN-21k)', VIL_T7),
    'retinanet_vil_t_1x': PaperRow(16.64, 182.7, VIL_DET, '40.8', VIL_T6),
    'retinanet_vil_s_1x': PaperRow(35.68, 254.8, VIL_DET, '44.2', VIL_T6),
    'retinanet_vil_m_1x': PaperRow(50.77, 330.4, VIL_DET, '46.8 (IN-21k)', VIL_T6),
    'retinanet_vil_b_1x': PaperRow(66.74, 420.9, VIL_DET, '47.8 (IN-21k)', VIL_T6),
    'retinanet_vil_t_3x_ms': PaperRow(16.64, 182.7, VIL_DET, '43.6', VIL_T6),
    'retinanet_vil_s_3x_ms': PaperRow(35.68, 254.8, VIL_DET, '45.9', VIL_T6),
    'retinanet_vil_m_3x_ms': PaperRow(50.77, 330.4, VIL_DET, '47.9 (IN-21k)', VIL_T6),
    'retinanet_vil_b_3x_ms': PaperRow(66.74, 420.9, VIL_DET, '48.6 (IN-21k)', VIL_T6),
    'maskrcnn_pale_t_1x': PaperRow(41, 306, (800, 1280), '47.4 / 42.7', PALE_T3),
    'maskrcnn_pale_s_1x': PaperRow(68, 432, (800, 1280), '48.4 / 43.7', PALE_T3),
    'maskrcnn_pale_b_1x': PaperRow(105, 595, (800, 1280), '49.3 / 44.2', PALE_T3),
    'upernet_pale_t_160k_ade20k': PaperRow(52, 996, (512, 2048), '50.4', PALE_T4),
    'upernet_pale_s_160k_ade20k': PaperRow(80, 1135, (512, 2048), '51.2', PALE_T4),
    'upernet_pale_b_160k_ade20k': PaperRow(119, 1311, (512, 2048), '52.2', PALE_T4),
    'upernet_vvt_s_160k_ade20k': PaperRow(55.5, 240, (512, 512), '46.8', VVT_T5),
    'upernet_vvt_m_160k_ade20k': PaperRow(77.9, 260, (512, 512), '48.1', VVT_T5),
    'upernet_vvt_l_160k_ade20k': PaperRow(91.9, 267, (512, 512), '48.8', VVT_T5),
}


def planned_configs(tasks=tuple(TASK_SCHEDULES)) -> list[tuple[str, str, str, str, str]]:
    """The planned config matrix as ``(stem, task, backbone, size, schedule)`` rows."""
    rows = []
    for task in tasks:
        for backbone, sizes in BACKBONE_SIZES.items():
            for size in sizes:
                for schedule in TASK_SCHEDULES[task]:
                    stem = f'{task}_{backbone}_{size}_{schedule}'
                    rows.append((stem, task, backbone, size, schedule))
    return rows


def relative_difference(ours: float | None, paper: float | None) -> float | None:
    """``(ours - paper) / paper``, or ``None`` if either number is missing."""
    if ours is None or paper is None:
        return None
    return (ours - paper) / paper


def is_flagged(ours: float | None, paper: float | None, tolerance: float = TOLERANCE) -> bool:
    """True if both numbers exist and differ by more than ``tolerance`` (relative)."""
    diff = relative_difference(ours, paper)
    return diff is not None and abs(diff) > tolerance


def flops_input(stem: str, task: str, backbone: str) -> tuple[int, int]:
    """(H, W) to count FLOPs at.

    The paper's size for this config; else the size the paper of the same
    task and backbone family uses (ViL-LS shares ViL's architecture, so its rows
    stay comparable with ViL's); else ``DEFAULT_INPUT[task]``.
    """
    if stem in PAPER:
        return PAPER[stem].flops_input
    family = 'vil' if backbone == 'vil_ls' else backbone
    prefixes = tuple(f'{task}_{family}_{size}_' for size in BACKBONE_SIZES[family])
    for other, row in PAPER.items():
        if other.startswith(prefixes):
            return row.flops_input
    return DEFAULT_INPUT[task]
