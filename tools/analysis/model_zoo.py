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
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / 'configs'
sys.path.insert(0, str(ROOT / 'tools'))

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
TASK_TITLES = {'maskrcnn': 'Mask R-CNN (COCO)', 'retinanet': 'RetinaNet (COCO)',
               'upernet': 'UperNet (ADE20K)'}
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


def build_model(config_path: str | Path, device: str = 'cpu'):
    """Build the config's model in eval mode (no weights loaded); returns (model, task scope)."""
    from mmengine.registry import MODELS, init_default_scope

    import _cli_common as common

    common.import_plugin()
    cfg = common.load_config(str(config_path), None, 'none')
    scope = common.register_scope_modules(cfg)
    init_default_scope(scope)
    return MODELS.build(cfg.model).to(device).eval(), scope


def count_parameters(model) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def _dummy_data_samples(scope: str, height: int, width: int) -> list:
    """One data sample with the image metadata the tensor-mode forward reads."""
    meta = dict(img_shape=(height, width), ori_shape=(height, width),
                pad_shape=(height, width), batch_input_shape=(height, width),
                scale_factor=(1.0, 1.0))
    if scope == 'mmdet':
        from mmdet.structures import DetDataSample
        return [DetDataSample(metainfo=meta)]
    from mmseg.structures import SegDataSample
    return [SegDataSample(metainfo=meta)]


def _module_macs(counter, model) -> dict[str, int]:
    """Multiply-adds per top-level submodule (``backbone``, ``neck``, heads).

    A submodule whose ``forward`` the model calls as a plain method (mmdet's
    ``roi_head.forward``, mmseg's ``decode_head.forward``) has no entry of its
    own: its outermost called descendants are summed instead.
    """
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(model).__name__

    def outermost(name: str, prefix: str) -> bool:
        parts = name.split('.')
        ancestors = ('.'.join(parts[:i]) for i in range(prefix.count('.') + 1, len(parts)))
        return not any(a in counts for a in ancestors)

    parts = {}
    for child, _ in model.named_children():
        prefix = f'{root}.{child}'
        parts[child] = sum(v for k, v in counts.items()
                           if (k == prefix or k.startswith(prefix + '.'))
                           and outermost(k, prefix)) // 2
    return {k: v for k, v in parts.items() if v}


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one fused attention call, as torch counts its CUDA kernels."""
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _flop_counter():
    """A ``FlopCounterMode`` that also counts the CPU flash-attention kernel.

    torch counts ``scaled_dot_product_attention`` only through its CUDA kernels;
    on CPU it dispatches to ``_scaled_dot_product_flash_attention_for_cpu``,
    which the stock counter skips (the ViL, ViL-LS and Pale attention would
    count as zero). The CUDA kernels' formula is registered for it.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return FlopCounterMode(display=False, custom_mapping={cpu_flash: _sdpa_flops})


def count_macs(fn, *args, **kwargs) -> int:
    """Multiply-adds of convolutions and matrix products in ``fn(*args, **kwargs)``."""
    import torch

    with torch.no_grad(), _flop_counter() as counter:
        fn(*args, **kwargs)
    # FlopCounterMode counts 2 FLOPs per multiply-add; the papers count multiply-adds.
    return counter.get_total_flops() // 2


def count_flops(model, scope: str, height: int, width: int,
                seed: int = 0) -> tuple[int, dict[str, int]]:
    """Multiply-adds of one ``mode='tensor'`` forward on a random ``height x width`` image.

    Returns:
        The total and its split over the model's top-level submodules.
    """
    import torch

    inputs = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(seed))
    inputs = inputs.to(next(model.parameters()).device)
    samples = _dummy_data_samples(scope, height, width)
    torch.manual_seed(seed)
    with torch.no_grad(), _flop_counter() as counter:
        model(inputs, samples, mode='tensor')
    return counter.get_total_flops() // 2, _module_macs(counter, model)


@dataclass
class Measurement:
    """What the tool measured for one config."""
    params: int | None = None
    flops: int | None = None
    flops_input: tuple[int, int] | None = None
    flops_parts: dict[str, int] | None = None
    seconds: float = 0.0


def measure(config_path: Path, skip_flops: bool,
            input_size: tuple[int, int], device: str = 'cpu') -> Measurement:
    """Parameters, and unless ``skip_flops`` FLOPs at ``input_size`` (H, W), of one config."""
    start = time.perf_counter()
    model, scope = build_model(config_path, device)
    result = Measurement(params=count_parameters(model))
    if not skip_flops:
        result.flops, result.flops_parts = count_flops(model, scope, *input_size)
        result.flops_input = input_size
    result.seconds = time.perf_counter() - start
    return result


def _fmt(value: float | None, digits: int) -> str:
    return '' if value is None else f'{value:.{digits}f}'


def _with_flag(ours: float | None, paper: float | None, digits: int) -> str:
    """Our number, with the relative difference appended when it is flagged."""
    text = _fmt(ours, digits)
    if is_flagged(ours, paper):
        text += f' **({relative_difference(ours, paper):+.1%})**'
    return text


def _parts_text(parts: dict[str, int] | None) -> str:
    return '' if not parts else ', '.join(f'{k} {v / 1e9:.1f}' for k, v in parts.items())


# Columns a run with --skip-flops does not recompute: FLOPs, FLOPs input, FLOPs by part.
FLOPS_CELLS = (5, 7, 8)
ROW = re.compile(r'^\| `(\w+)`')
GENERATED_BY = re.compile(r'^Generated by `([^`]*)`', re.MULTILINE)


def read_page(text: str) -> tuple[str | None, dict[str, list[str]]]:
    """The command that generated an existing page and its table rows as ``{stem: cells}``."""
    rows = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = line.strip().strip('|').split(' | ')
    found = GENERATED_BY.search(text)
    return (found.group(1) if found else None), {k: [c.strip() for c in v] for k, v in rows.items()}


def merge_row(stem: str, cells: list[str], measurements: dict,
              previous: dict[str, list[str]]) -> list[str]:
    """A row's cells, keeping what this run did not recompute from the ``previous`` page.

    A config this run did not measure keeps its earlier row as it is; one measured
    without FLOPs keeps its earlier FLOPs cells.
    """
    old = previous.get(stem)
    if old is None or len(old) != len(cells):
        return cells
    found = measurements.get(stem)
    if found is None:
        return old
    if found.flops is None:
        cells = list(cells)
        for i in FLOPS_CELLS:
            cells[i] = old[i]
    return cells


def table(task: str, rows: list, measurements: dict,
          previous: dict[str, list[str]] | None = None) -> str:
    """The markdown table of one task.

    Args:
        task: ``'maskrcnn'``, ``'retinanet'`` or ``'upernet'``.
        rows: The task's planned configs (:func:`planned_configs`).
        measurements: What this run measured, by config stem.
        previous: Rows of the page being updated (:func:`read_page`); cells this
            run did not recompute are taken from there.
    """
    metric = 'mIoU (SS)' if task == 'upernet' else ('AP' if task == 'retinanet'
                                                     else 'AP box / mask')
    header = ['config', 'backbone', 'schedule', 'params (M)', 'paper params (M)',
              'FLOPs (G)', 'paper FLOPs (G)', 'FLOPs input (HxW)', 'FLOPs by part (G)',
              f'paper {metric}', f'our {metric}', 'paper source']
    lines = ['| ' + ' | '.join(header) + ' |', '|---' * len(header) + '|']
    for stem, _, backbone, size, schedule in rows:
        paper = PAPER.get(stem)
        cells = [''] * len(header)
        cells[1] = f'{BACKBONE_TITLES[backbone]}-{size.upper()}'
        cells[2] = SCHEDULE_TITLES[schedule]
        found = measurements.get(stem)
        if found is None:
            # Not measured by this run: a planned config without a file yet is labelled as such.
            cells[0] = f'`{stem}`' + ('' if (CONFIG_DIR / f'{stem}.py').is_file() else ' (no config yet)')
        else:
            cells[0] = f'`{stem}`'
            params_m = found.params / 1e6 if found.params is not None else None
            gflops = found.flops / 1e9 if found.flops is not None else None
            cells[3] = _with_flag(params_m, paper and paper.params_m, 2)
            cells[5] = _with_flag(gflops, paper and paper.gflops, 1)
            cells[7] = 'x'.join(map(str, found.flops_input)) if found.flops_input else ''
            cells[8] = _parts_text(found.flops_parts)
        if paper:
            cells[4] = str(paper.params_m)
            cells[6] = str(paper.gflops)
            cells[9] = paper.metric
            cells[11] = paper.source
        cells = merge_row(stem, cells, measurements, previous or {})
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


HEADER = '''# Model zoo

Generated by `{command}`{update}; do not edit by hand (the text lives in
`tools/analysis/model_zoo.py`).

**Columns.** *params* and *FLOPs* are measured by the tool on the configs in
`configs/`; the *paper* columns and the *paper AP / mIoU* are the papers'
numbers (source per row), **not ours**. The *our AP / mIoU* columns stay empty
until the configs are trained on real COCO / ADE20K; they are never filled with
paper numbers. 1x and 3x + MS configs build the same model, so they share their
params and FLOPs. A row whose params or FLOPs differ from the paper by more than
2% shows the difference in bold, e.g. **(+5.0%)**; the reasons are in the notes
below the tables.

**What is counted.** Parameters: `sum(p.numel())` of the built detector /
segmentor (auxiliary heads included, no ImageNet classification head). FLOPs:
multiply-adds (G = 1e9) of convolutions and matrix products (`linear`, `matmul`,
`einsum`, `bmm`, `scaled_dot_product_attention`, ...), counted at the ATen level
by `torch.utils.flop_counter.FlopCounterMode`, so the custom attention ops of
ViL, ViL-LS, VVT and Pale are counted in full. (torch's counter has no formula
for the CPU flash-attention kernel that `scaled_dot_product_attention` runs on
CPU, so the ViL, ViL-LS and Pale attention would count as zero; the tool adds
one.) Softmax, norms, activations, element-wise arithmetic, RoIAlign, NMS and
interpolation are not counted. The forward is mmdet's / mmseg's `mode='tensor'`
forward, as their `get_flops.py` use it (Mask R-CNN: backbone, FPN, RPN, box head
on the RPN proposals, at most 1000, and mask head on the first 100; RetinaNet:
backbone, FPN, head; UperNet: backbone and decode head, no auxiliary head), on one
unpadded random image of the size in the
*FLOPs input* column: the size the backbone's paper uses for the task (ViL, and
ViL-LS with it: 800x1333; Pale detection: 1280x800, i.e. 800x1280; Pale
segmentation: 512x2048; VVT segmentation: 512x512, see below), else 800x1280
(mmdet's `get_flops` default) for detection and 512x512 (the training crop) for
segmentation.
'''

NOTES = '''## Notes on the flagged differences

- **ViL detector parameters.** The ViL paper's detector counts include the
  official backbone's 1000-class ImageNet head, which the detectors never use
  (with the head added back, Mask R-CNN and RetinaNet ViL-T/S are within 0.25%
  of the paper; `tests/test_configs.py`).
- **FLOPs counters.** The papers do not say which counter they used. The
  mmdet-2.x-era `get_flops` (mmcv's hook-based counter) counts only modules
  (convolutions, `nn.Linear`, norms, ...) and misses matrix products written as
  functions (`q @ k^T`, `einsum`), i.e. most of the attention. fvcore and
  mmengine's `get_model_complexity_info` (`torch.jit` traces) count those, but
  have no handle for `scaled_dot_product_attention`, through which the ViL,
  ViL-LS and Pale attention runs (mmengine's count of the ViL backbone left it
  out when we tried). We count all of them, so attention-heavy models can land
  above a paper's number.
- **Mask R-CNN heads.** Mask R-CNN totals depend on what reaches the RoI heads:
  here the RPN's own proposals on a random image (up to 1000) and the mask head
  on the first 100, as mmdet's tensor-mode forward does; RPN and RoI heads cost
  a few tens of G each whatever the backbone (the *FLOPs by part* column). A
  paper that counted fewer proposals or left the heads out lands lower. The ViL
  RetinaNet rows, which have no RoI stage, are the check on the rest of the
  count: when they agree with the paper and the Mask R-CNN rows do not, compare
  the paper's number with the backbone + neck + rpn_head parts.
- **VVT segmentation input size.** The VVT paper gives UperNet GFLOPs without
  a size; its Swin-T row (237 G) matches Swin-T UperNet at 512x512 (Swin's own
  paper reports 945 G at 512x2048), so the VVT numbers are read as 512x512.
- **Pale.** Sizes as the paper states them (41M, 306G, ...) are rounded to
  whole numbers, so differences under ~1.5% are rounding. The Mask R-CNN FLOPs
  land 2-3% below the paper's: a likely cause (not verified) is that the
  hook-based counter of mmdet 2.x's `get_flops`, which the Swin/CSWin-style code
  the Pale paper follows used, also counts norms, activations, pooling and
  upsampling, which this tool leaves out; the RoI-head convention above also
  moves the total by a few G.
- **Rows without paper numbers.** The Transformer-LS paper reports no detection
  or segmentation results, the VVT paper no detection results and VVT-T no
  segmentation result, the Pale paper no RetinaNet or 3x + MS results, and the
  ViL paper no segmentation results: those rows have only our measurements.
'''


def render(tasks: list[str], measurements: dict, command: str,
           previous_page: str | None = None) -> str:
    """The whole ``docs/model_zoo.md`` text.

    Args:
        tasks: Tables to write.
        measurements: What this run measured, by config stem.
        command: The command line of this run.
        previous_page: The text of the page this run updates, if any. Its tables
            are all kept, with this run's measurements merged in, and the header
            names both the command that made the page and this one.
    """
    update = ''
    previous = {}
    if previous_page is not None:
        made_by, previous = read_page(previous_page)
        tasks = [t for t in TASK_SCHEDULES if t in tasks or f'## {TASK_TITLES[t]}\n' in previous_page]
        if made_by and made_by != command:
            update, command = f', updated by `{command}`', made_by
    parts = [HEADER.format(command=command, update=update)]
    for task in tasks:
        rows = table(task, planned_configs([task]), measurements, previous)
        parts.append(f'## {TASK_TITLES[task]}\n\n{rows}\n')
    parts.append(NOTES)
    return '\n'.join(parts)


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


def model_key(config_path: Path) -> str:
    """Text identifying the model a config builds (1x and 3x + MS configs share one)."""
    from mmengine.config import Config
    return repr(Config.fromfile(str(config_path)).model.to_dict())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--tasks', nargs='+', choices=list(TASK_SCHEDULES),
                        default=list(TASK_SCHEDULES), help='tables to build')
    parser.add_argument('--configs', nargs='+', metavar='STEM',
                        help='measure only these configs (file names without .py); '
                             'other rows keep their cells from an existing --out page, '
                             'else stay empty')
    parser.add_argument('--skip-flops', action='store_true',
                        help='count parameters only (seconds per config instead of minutes)')
    parser.add_argument('--device', default='cpu',
                        help="where to run the counted forward passes, e.g. 'cuda' "
                             '(same counts, much faster)')
    parser.add_argument('--out', default=str(ROOT / 'docs' / 'model_zoo.md'),
                        help='markdown file to write; a partial run (--tasks, --configs, '
                             '--skip-flops) merges its rows into an existing page')
    args = parser.parse_args(argv)

    rows = planned_configs(args.tasks)
    known = {stem for stem, *_ in rows}
    unknown = sorted(set(args.configs or ()) - known)
    if unknown:
        raise SystemExit(f'--configs {unknown} are not in the planned matrix of '
                         f'--tasks {args.tasks}; names look like maskrcnn_vil_t_1x')
    out = Path(args.out)
    complete = (set(args.tasks) == set(TASK_SCHEDULES) and not args.configs
                and not args.skip_flops)
    previous_page = None
    if not complete and out.is_file():
        # A partial run updates the page instead of replacing it: the rows and
        # cells it did not measure took up to 20 minutes to make.
        previous_page = out.read_text()
        if not read_page(previous_page)[1]:
            raise SystemExit(f'{out} exists and has no model-zoo table rows; this partial run '
                             '(--tasks, --configs or --skip-flops) would only merge into a '
                             'model-zoo page: pass a new --out file')
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
        flops = '' if found.flops is None else (
            f', {found.flops / 1e9:.1f} GMACs at {found.flops_input}')
        print(f'{stem}: {found.params / 1e6:.2f}M params{flops} ({found.seconds:.0f} s)',
              flush=True)
    command = 'python tools/analysis/model_zoo.py ' + ' '.join(
        argv if argv is not None else sys.argv[1:])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(args.tasks, measurements, command.strip(), previous_page))
    if previous_page is None:
        print(f'wrote {out}' + ('' if complete else ' (a partial page: only what this run '
                                                    'measured)'))
    else:
        print(f'updated {out}: {len(measurements)} measured rows replaced'
              f'{" (their FLOPs cells kept)" if args.skip_flops else ""}; '
              'every other row and table kept as it was')


if __name__ == '__main__':
    main()
