"""Training throughput: images/s and peak memory of real configs on toy data, against mmdet's or mmseg's Swin-T.

Each config, and the baseline (unless ``--baseline`` names another: mmdet's own
Mask R-CNN Swin-T config for detection configs, mmseg's own UperNet Swin-T config
for segmentation ones), trains ``--warmup + --iters`` iterations in this process
with mmengine's Runner, as ``tools/train.py`` runs it, on a toy dataset of
``--image-size`` images (``tools/make_toy_data.py``: COCO for mmdet configs,
ADE20K for mmseg ones, written to ``<out-dir>/toy_<layout>_<H>x<W>`` unless
``--data-root`` gives one). The configs measured together are of one library. The config's
pipeline, model and optimiser are kept; only the data (``use_toy_data``: 3 or 4
classes), the loop (iterations, no validation, no checkpoints), the ImageNet
weights (none: they change neither time nor memory) and, per ``--dtypes``, the
optimiser wrapper (``fp16`` / ``bf16``: ``AmpOptimWrapper`` as ``--amp`` sets it)
change.

* Time per iteration: from right before the model's ``train_step`` to right after
  it (CUDA synchronised): forward, backward and optimiser step, without data
  loading (loader workers prepare batches meanwhile). The median over ``--iters``
  iterations after ``--warmup``; images/s = ``--batch`` / median.
* Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` during training minus
  what was allocated before the first iteration (the model's weights): gradients,
  optimiser states and activations; on CPU the growth of the resident set (see
  ``visattn_mm.analysis.benchmarking``).

Ratios divide by the baseline's row of the same dtype. Writes
``<out-dir>/train_throughput.csv`` and prints a markdown table.

Examples (a GPU; the commands of docs/benchmarks.md)::

    python tools/analysis/train_throughput.py configs/maskrcnn_vil_s_1x.py \\
        configs/maskrcnn_pale_t_1x.py --batch 2 --dtypes fp32,fp16 --iters 20
    python tools/analysis/train_throughput.py configs/upernet_vil_s_160k_ade20k.py --batch 2 --dtypes bf16
"""

from __future__ import annotations

import argparse
import gc
import os.path as osp
import statistics
import time

import torch
from mmengine.hooks import Hook

from visattn_mm import cli
from visattn_mm import toy_data as toy
from visattn_mm.analysis import benchmarking as bench

SWIN_T_CONFIG = 'mmdet::swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py'
#: The baseline of each library's configs (``default_scope``), and the toy layout its configs train on.
BASELINES = dict(
    mmdet=SWIN_T_CONFIG, mmseg='mmseg::swin/swin-tiny-patch4-window7-in1k-pre_upernet_8xb2-160k_ade20k-512x512.py'
)
TOY_LAYOUTS = dict(mmdet='coco', mmseg='ade20k')
AMP_DTYPES = dict(fp16='float16', bf16='bfloat16')
COLUMNS = (
    'config',
    'dtype',
    'batch',
    'height',
    'width',
    'iters',
    'step_ms',
    'images_per_s',
    'peak_mem_mib',
    'images_per_s_vs_baseline',
    'peak_mem_mib_vs_baseline',
    'status',
)


class StepTimer(Hook):
    """Times every ``train_step`` and meters the peak memory of the whole training.

    Lowest priority: its ``before_train_iter`` runs after every other hook's,
    right before the step.
    """

    priority = 'LOWEST'

    def __init__(self, device, meter):
        self.device, self.meter = device, meter
        self.seconds, self.peak_bytes, self._begin = [], None, None

    def before_train(self, runner):
        self.meter.start()

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        bench.synchronize(self.device)
        self._begin = time.perf_counter()

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        bench.synchronize(self.device)
        self.seconds.append(time.perf_counter() - self._begin)

    def after_train(self, runner):
        self.peak_bytes = self.meter.peak()


def load_config(name):
    """A config file, or a library's config as ``'mmdet::path/in/its/configs.py'``."""
    if '::' in name:
        from mmengine.hub import get_config

        return get_config(name)
    from mmengine.config import Config

    return Config.fromfile(name)


def library_of(names):
    """The ``default_scope`` (``'mmdet'`` or ``'mmseg'``) that the configs ``names`` share.

    Raises:
        SystemExit: For configs of another library, or of both.
    """
    scopes = {name: load_config(name).get('default_scope') for name in names}
    found = set(scopes.values())
    if len(found) != 1 or not found <= set(BASELINES):
        listed = ', '.join(f'{name}: {scope}' for name, scope in scopes.items())
        raise SystemExit(
            f'train_throughput.py measures mmdet configs or mmseg configs, one library per run ({listed}); '
            'run it once per library'
        )
    return found.pop()


def config_label(name):
    return osp.splitext(osp.basename(name.split('::')[-1]))[0]


def prepare_config(cfg, data_root, dtype, args, work_dir):
    """``cfg`` set up for one throughput run (see the module doc), in place."""
    toy.use_toy_data(cfg, data_root)
    cfg.model.backbone.init_cfg = None
    loader = cfg.train_dataloader
    loader.update(batch_size=args.batch, num_workers=args.workers, persistent_workers=args.workers > 0)
    cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=args.warmup + args.iters)
    for key in ('val_dataloader', 'val_cfg', 'val_evaluator', 'test_dataloader', 'test_cfg', 'test_evaluator'):
        cfg[key] = None
    cfg.param_scheduler = []
    cfg.default_hooks.checkpoint = None
    if dtype in AMP_DTYPES:
        cfg.optim_wrapper.update(type='AmpOptimWrapper', dtype=AMP_DTYPES[dtype], loss_scale='dynamic')
    cfg.work_dir = work_dir
    cfg.log_level = 'WARNING'
    cfg.launcher = 'none'


def run_case(name, dtype, data_root, args, device, meter):
    """One config at one dtype: a row of the table."""
    label = config_label(name)
    row = dict(
        config=label,
        dtype=dtype,
        batch=args.batch,
        height=args.image_size[0],
        width=args.image_size[1],
        role='baseline' if name == args.baseline else 'measured',
    )
    cfg = load_config(name)
    prepare_config(cfg, data_root, dtype, args, osp.join(args.out_dir, f'{label}_{dtype}'))
    cli.register_scope_modules(cfg)
    cfg.experiment_name = f'throughput_{label}_{dtype}_{time.strftime("%Y%m%d_%H%M%S")}'
    timer = StepTimer(device, meter)
    try:
        runner = cli.build_runner(cfg)
        runner.register_hook(timer)
        runner.train()
        timed = timer.seconds[args.warmup :]
        step = statistics.median(timed)
        row.update(
            iters=len(timed),
            step_ms=step * 1e3,
            images_per_s=args.batch / step,
            peak_mem_mib=timer.peak_bytes / bench.MIB,
            status='ok',
        )
    except (RuntimeError, torch.cuda.OutOfMemoryError) as error:
        row['status'] = f'failed: {str(error).splitlines()[0][:120]}'
    finally:
        runner = None
        gc.collect()
        if device.type == 'cuda':
            torch.cuda.empty_cache()
    print(
        f"{label} {dtype} b{args.batch}: {bench.format_value(row.get('images_per_s'))} img/s, "
        f"{bench.format_value(row.get('peak_mem_mib'))} MiB {row['status']}",
        flush=True,
    )
    return row


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('configs', nargs='+', help='mmdet config files to measure')
    parser.add_argument(
        '--baseline',
        default=None,
        help='config the ratios refer to (default: the Swin-T config of the configs\' library: '
        + ', '.join(f'{scope}: {name}' for scope, name in BASELINES.items())
        + ')',
    )
    parser.add_argument('--image-size', default='800x1333', help='HEIGHTxWIDTH of the toy images')
    parser.add_argument(
        '--data-root', default=None, help='toy COCO or ADE20K dataset to use (default: made in the out dir)'
    )
    parser.add_argument('--batch', type=int, default=2, help='images per iteration')
    parser.add_argument('--dtypes', default='fp32', help='fp32, fp16, bf16 (the last two: AMP, GPU only)')
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--iters', type=int, default=10, help='timed iterations')
    parser.add_argument('--workers', type=int, default=2, help='data loader workers')
    parser.add_argument('--out-dir', default='work_dirs/train_throughput')
    args = parser.parse_args(argv)
    args.image_size = bench.parse_size(args.image_size, '--image-size')
    args.dtypes = bench.check_choices(bench.parse_list(args.dtypes), bench.DTYPES, '--dtypes')
    if args.batch < 1 or args.iters < 1 or args.warmup < 0 or args.workers < 0:
        raise SystemExit('--batch and --iters must be >= 1, --warmup and --workers >= 0')
    if set(args.dtypes) & set(AMP_DTYPES) and not torch.cuda.is_available():
        raise SystemExit(
            '--dtypes fp16/bf16 train with AMP, which needs a GPU (mmengine\'s '
            'AmpOptimWrapper); use --dtypes fp32 on this machine'
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')  # the Runner's choice
    meter = bench.memory_meter(device)
    machine = bench.machine_description(device)
    print(machine, flush=True)
    cli.import_plugin()
    scope = library_of(args.configs + ([args.baseline] if args.baseline else []))
    args.baseline = args.baseline or BASELINES[scope]
    height, width = args.image_size
    make = toy.make_coco_instances if scope == 'mmdet' else toy.make_ade20k_layout
    data_root = args.data_root or make(
        osp.join(args.out_dir, f'toy_{TOY_LAYOUTS[scope]}_{height}x{width}'),
        num_train=max(8, 2 * args.batch),
        num_val=1,
        image_size=(height, width),
    )
    rows = []
    with bench.UntilInterrupted('train_throughput', lambda: f'the {len(rows)} rows') as run:
        for dtype in args.dtypes:
            for name in [args.baseline, *(c for c in args.configs if c != args.baseline)]:
                rows.append(run_case(name, dtype, data_root, args, device, meter))
    bench.add_ratio_columns(
        rows, 'baseline', ('dtype', 'batch', 'height', 'width'), ('images_per_s', 'peak_mem_mib'), name_key='role'
    )
    print(
        f'\n{machine}; {device.type}; baseline {config_label(args.baseline)}; median of '
        f'{args.iters} iterations after {args.warmup} warm-up\n'
    )
    print(bench.format_table(rows, COLUMNS))
    csv_path = osp.join(args.out_dir, 'train_throughput.csv')
    bench.write_csv(rows, COLUMNS, csv_path)
    print(f'\nwrote {csv_path}')
    run.exit_if_interrupted()
    return rows


if __name__ == '__main__':
    main()
