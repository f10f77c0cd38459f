"""Step costs on the CPU: peak memory, bytes moved, layout bytes and ops launched of one training step,
as a GPU would pay them, against Swin-T and ResNet-50 traced in the same run.

Each model runs one step (forward + backward by default) on fake tensors with CUDA's
dispatch decisions emulated, through ``visattn_mm.analysis.step_cost`` (its docstring
says what is counted and how). No GPU and no data are needed: a batch-8 800x1333 step
takes seconds. Counts, not times: milliseconds stay a GPU measurement
(``benchmark.py --device cuda``).

The baselines are those of the H100 measurements in ``docs/benchmarks.md``: Swin-T is
timm's ``swin_tiny_patch4_window7_224`` as a dense backbone (any input size, four maps),
ResNet-50 mmdet's Mask R-CNN backbone (stem and first stage frozen, BN in eval mode).

``--configs`` adds whole models of configs (``configs/*.py``) and, as the baseline of each of
ours, mmdet's or mmseg's own Swin-T version of the same detector or segmentor (from the installed
package), at ``--batch`` / ``--size`` and at the configs' training settings (``--config-settings``);
in mmdet's / mmseg's tensor mode: backbone, neck and dense heads (a segmentor's decode and
auxiliary heads, a detector's RPN or RetinaNet head), with the sum of the outputs' means as the loss. A
two-stage detector's RoI heads need proposals from NMS, which fake tensors cannot run:
they are left out, and the row says so in ``parts``.

Writes ``<out-dir>/step_cost.csv`` (one row per model and path), ``step_cost_classes.csv``
(per op class) and ``step_cost_ops.csv`` (per op), and prints a markdown table. ``--estimate H100``
(or another fitted GPU kind) adds ``est_ms``, the step time estimated from the counts
(``visattn_mm.analysis.step_time``): an estimate to rank changes between device calls, never a
measurement.

Example (the table of docs/benchmarks.md)::

    .venv/bin/python tools/analysis/step_cost_report.py --models vil-s,vil-ls-s,pale-t,vvt-s \
        --impls auto,triton --configs maskrcnn_vil_s_1x,upernet_vvt_s_160k_ade20k
"""

from __future__ import annotations

import argparse
import os.path as osp
import time

import torch

from visattn_mm.analysis import benchmarking as bench
from visattn_mm.analysis import step_time_rates
from visattn_mm.analysis.benchmark_backbones import MODEL_ZOO, build_backbone
from visattn_mm.analysis.flops import build_model
from visattn_mm.analysis.step_cost import AUTOCAST_DTYPES, MODES, trace_step
from visattn_mm.models import FAMILIES
from visattn_mm.ops.impl import ATTENTION_IMPLS, attention_impl

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
CONFIG_DIR = osp.join(ROOT, 'configs')  # where --configs names are looked up
BASELINES = ('swin-t', 'r50')
# mmdet's and mmseg's own Swin-T version of each kind of our configs, from the installed packages:
# the baseline of every --configs row of that kind.
SWIN_T_CONFIGS = {
    'maskrcnn': ('mmdet', 'swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'),
    'retinanet': ('mmdet', 'swin/retinanet_swin-t-p4-w7_fpn_1x_coco.py'),
    'upernet': ('mmseg', 'swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'),
}
# The configs' training settings: images per GPU, input (crop) size.
TRAINING_SETTINGS = {'maskrcnn': (2, (800, 1333)), 'retinanet': (2, (800, 1333)), 'upernet': (4, (512, 512))}
COLUMNS = (
    'model',
    'impl',
    'baseline',
    'parts',
    'batch',
    'height',
    'width',
    'dtype',
    'mode',
    'peak_gib',
    'peak_gib_vs_swin-t',
    'peak_gib_vs_r50',
    'launched',
    'launched_vs_swin-t',
    'blocks',
    'launched_per_block',
    'launched_per_block_vs_swin-t',
    'layout_gb',
    'layout_gb_vs_swin-t',
    'moved_gb',
    'moved_gb_vs_swin-t',
    'saved_gb',
    'tflops',
    'peak_gib_vs_baseline',
    'moved_gb_vs_baseline',
    'launched_vs_baseline',
    'trace_s',
    'est_ms',
)
CLASS_COLUMNS = ('model', 'impl', 'op_class', 'count', 'launched', 'gflops', 'read_gb', 'written_gb', 'saved_gb')
OP_COLUMNS = ('model', 'impl', 'op', 'op_class', 'count', 'launched', 'gflops', 'read_gb', 'written_gb', 'saved_gb')


def config_kind(config):
    """``'maskrcnn'``, ``'retinanet'`` or ``'upernet'`` for one of our configs (by name), else None."""
    kind = osp.basename(config).split('_', 1)[0]
    return kind if kind in SWIN_T_CONFIGS else None


def swin_t_config(kind):
    """The path of mmdet's / mmseg's Swin-T config of ``kind`` in the installed package, and its row name."""
    import importlib

    package, relative = SWIN_T_CONFIGS[kind]
    root = osp.dirname(importlib.import_module(package).__file__)
    return osp.join(root, '.mim', 'configs', relative), f'{package}:{osp.splitext(osp.basename(relative))[0]}'


def build_config_model(config):
    """The model of ``configs/<config>.py`` (or a path) and a forward running its dense parts.

    Returns:
        tuple: ``(model, forward(model, images) -> outputs, parts)``, ``parts`` naming what runs.
    """
    path = config if config.endswith('.py') else osp.join(CONFIG_DIR, f'{config}.py')
    if not osp.exists(path):
        raise SystemExit(f'--configs: {path} does not exist')
    model, scope = build_model(path)
    heads = [
        name
        for name in ('decode_head', 'auxiliary_head', 'rpn_head', 'bbox_head')
        if getattr(model, name, None) is not None
    ]
    parts = '+'.join(['backbone'] + (['neck'] if getattr(model, 'with_neck', False) else []) + heads)
    if getattr(model, 'roi_head', None) is not None:
        parts += ' (roi_head left out: it needs NMS proposals)'

    def forward(net, images):
        features = net.extract_feat(images)
        return [getattr(net, head)(features) for head in heads] or features

    return model, forward, parts


def count_blocks(model):
    """The backbone's residual blocks (``*Block``: ours and Swin's; ``Bottleneck``: ResNet's).

    Launches per block compare backbones of different depths (Pale-T has 22 blocks, VVT-S 18,
    Swin-T 12): a step's launches grow with depth, which is not waste.
    """
    backbone = getattr(model, 'backbone', model)
    return sum(type(m).__name__.endswith(('Block', 'Bottleneck')) for m in backbone.modules())


def _gb(value):
    return value / 1e9


def trace_rows(name, model, forward, parts, impls, args, batch, size, baseline=None):
    """Traces ``model`` once per impl on ``batch`` images of ``size``; returns (summary rows, class
    rows, op rows). ``baseline``: the row name of the model to compare with (whole models)."""
    rows, class_rows, op_rows = [], [], []
    model.train()
    blocks = count_blocks(model)
    for impl in impls:
        begin = time.perf_counter()
        with attention_impl(impl if impl != bench.NO_IMPL else 'auto'):
            cost = trace_step(
                model,
                (batch, 3, *size),
                dtype=args.dtype,
                mode=args.mode,
                device_type=args.device_type,
                forward=forward,
            )
        summary = cost.summary()
        rows.append(
            dict(
                model=name,
                impl=impl,
                baseline=baseline,
                parts=parts,
                batch=batch,
                height=size[0],
                width=size[1],
                dtype=args.dtype,
                mode=args.mode,
                peak_gib=summary['peak_bytes'] / bench.GIB,
                launched=summary['launched'],
                blocks=blocks,
                launched_per_block=summary['launched'] / blocks if blocks else None,
                layout_gb=_gb(summary['layout_bytes']),
                moved_gb=_gb(summary['bytes_moved']),
                saved_gb=_gb(summary['bytes_saved']),
                tflops=summary['flops'] / 1e12,
                trace_s=time.perf_counter() - begin,
                est_ms=estimate_step_ms(cost, args.dtype, args.estimate, name) if args.estimate else None,
            )
        )
        for key, table, items in (('op_class', class_rows, cost.by_class().items()), ('op', op_rows, cost.ops.items())):
            for label, op in sorted(items, key=lambda item: -item[1].bytes_moved):
                table.append(
                    {
                        'model': name,
                        'impl': impl,
                        key: label,
                        'op_class': op.op_class,
                        'count': op.count,
                        'launched': op.launched,
                        'gflops': op.flops / 1e9,
                        'read_gb': _gb(op.bytes_read),
                        'written_gb': _gb(op.bytes_written),
                        'saved_gb': _gb(op.bytes_saved),
                    }
                )
        print(
            f"{name:>9} {impl:>6} {batch}x{size[0]}x{size[1]}: peak {rows[-1]['peak_gib']:.2f} GiB, "
            f"{summary['launched']} ops, "
            f"layout {rows[-1]['layout_gb']:.1f} GB ({rows[-1]['trace_s']:.1f} s)",
            flush=True,
        )
    return rows, class_rows, op_rows


def estimate_step_ms(cost, dtype, gpu, name):
    """The step's estimated time on ``gpu`` (``visattn_mm.analysis.step_time``): an estimate, not a
    measurement; None (and a note) where a term of the step has no fitted cost."""
    from visattn_mm.analysis import step_time, step_time_rates

    try:
        return step_time.estimate_ms(step_time.step_terms(cost, dtype), step_time_rates.COSTS[gpu])
    except KeyError as missing:
        print(f'{name}: no estimate: {missing}', flush=True)
        return None


def add_ratios(rows):
    """Ratios to the baselines' rows of the same run (same batch, size, dtype, mode)."""
    keys = ('batch', 'height', 'width', 'dtype', 'mode')
    bench.add_ratio_columns(
        rows, 'swin-t', keys, ('peak_gib', 'launched', 'launched_per_block', 'layout_gb', 'moved_gb')
    )
    bench.add_ratio_columns(rows, 'r50', keys, ('peak_gib',))
    reference = {(row['model'], *(row[k] for k in keys)): row for row in rows}
    for row in rows:
        base = reference.get((row.get('baseline'), *(row[k] for k in keys)))
        for key in ('peak_gib', 'moved_gb', 'launched'):
            row[f'{key}_vs_baseline'] = row[key] / base[key] if base and base[key] else None
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ours = [name for name in MODEL_ZOO if name not in BASELINES]
    parser.add_argument(
        '--models',
        default=','.join(family.compared_model for family in FAMILIES),
        help=f'comma-separated backbones, "all" or "none": {", ".join(ours)} (the baselines '
        f'{", ".join(BASELINES)} are always traced)',
    )
    parser.add_argument(
        '--configs', default='', help='comma-separated config names (configs/<name>.py) or paths: whole models'
    )
    parser.add_argument(
        '--impls',
        default='auto,triton',
        help=f'attention implementations of our models, from {", ".join(ATTENTION_IMPLS)}',
    )
    parser.add_argument(
        '--config-settings',
        default='args,training',
        help="comma-separated: 'args' traces --configs at --batch and --size, 'training' at each config's "
        'training setting (Mask R-CNN and RetinaNet 2 images of 800x1333, UperNet 4 crops of 512x512)',
    )
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--size', default='800x1333', help='HEIGHTxWIDTH')
    parser.add_argument('--dtype', default='bf16', choices=list(AUTOCAST_DTYPES), help='fp32, or bf16 / fp16 autocast')
    parser.add_argument('--mode', default='fwd+bwd', choices=list(MODES))
    parser.add_argument(
        '--device-type',
        default='cuda',
        choices=('cuda', 'cpu'),
        help="whose dispatch decisions the step takes: CUDA's (emulated) or the CPU's",
    )
    parser.add_argument(
        '--estimate',
        choices=list(step_time_rates.COSTS),
        help='add est_ms: the step time on this GPU kind estimated from the counts (an estimate, never a '
        'measurement: see tools/analysis/step_time_calibration.py)',
    )
    parser.add_argument('--out-dir', default='work_dirs/step_cost')
    args = parser.parse_args(argv)
    if args.models in ('all', 'none'):
        args.models = ours if args.models == 'all' else []
    else:
        args.models = bench.check_choices(bench.parse_list(args.models, option='--models'), ours, '--models')
    args.configs = [c.strip() for c in args.configs.split(',') if c.strip()]
    args.config_settings = bench.check_choices(
        bench.parse_list(args.config_settings, option='--config-settings'), ('args', 'training'), '--config-settings'
    )
    args.impls = bench.check_choices(bench.parse_list(args.impls, option='--impls'), ATTENTION_IMPLS, '--impls')
    args.size = bench.parse_size(args.size, '--size')
    if args.batch < 1:
        raise SystemExit('--batch must be >= 1')
    return args


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(0)
    rows, class_rows, op_rows = [], [], []
    here = [(args.batch, args.size)]
    jobs = [
        (name, lambda n=name: (build_backbone(n), None, 'backbone'), [bench.NO_IMPL], here, None) for name in BASELINES
    ]
    jobs += [
        (name, lambda n=name: (build_backbone(n), None, 'backbone'), args.impls, here, None) for name in args.models
    ]
    config_jobs, baselines = [], {}
    for config in args.configs:
        kind = config_kind(config)
        settings = (here if 'args' in args.config_settings else []) + (
            [TRAINING_SETTINGS[kind]] if kind and 'training' in args.config_settings else []
        )
        baseline = None
        if kind:
            path, baseline = swin_t_config(kind)
            baselines.setdefault(baseline, (path, set()))[1].update(settings)
        config_jobs.append((config, lambda c=config: build_config_model(c), args.impls, settings or here, baseline))
    jobs += [
        (name, lambda p=path: build_config_model(p), [bench.NO_IMPL], sorted(settings), None)
        for name, (path, settings) in baselines.items()
    ]
    jobs += config_jobs
    for name, build, impls, settings, baseline in jobs:
        model, forward, parts = build()
        for batch, size in settings:
            found = trace_rows(name, model, forward, parts, impls, args, batch, size, baseline)
            for table, new in zip((rows, class_rows, op_rows), found):
                table += new
        del model
    add_ratios(rows)
    print(
        f'\nstep costs, {args.mode}, batch {args.batch}, {args.size[0]}x{args.size[1]}, {args.dtype}, '
        f'{args.device_type} dispatch (traced on fake tensors)\n'
    )
    shown = [c for c in COLUMNS if c not in ('dtype', 'mode')]
    if not args.configs:
        shown = [
            c for c in shown if c not in ('batch', 'height', 'width', 'baseline') and not c.endswith('_vs_baseline')
        ]
    if args.estimate:
        print(
            f'est_ms: ESTIMATED {args.estimate} step time from these counts, costs fitted at '
            f'{step_time_rates.FITTED_AT} on {", ".join(step_time_rates.FITTED_ON[args.estimate])}; '
            'an estimate to rank changes, not a measurement\n'
        )
    else:
        shown.remove('est_ms')
    print(bench.format_table(rows, shown))
    for file_name, table, columns in (
        ('step_cost.csv', rows, COLUMNS),
        ('step_cost_classes.csv', class_rows, CLASS_COLUMNS),
        ('step_cost_ops.csv', op_rows, OP_COLUMNS),
    ):
        bench.write_csv(table, columns, osp.join(args.out_dir, file_name))
    print(f'\nwrote {args.out_dir}/step_cost.csv, step_cost_classes.csv, step_cost_ops.csv')
    return rows


if __name__ == '__main__':
    main()
