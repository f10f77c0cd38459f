"""Evaluate a checkpoint with an mmdet or mmseg config.

Usage::

    python tools/test.py CONFIG CHECKPOINT [--work-dir DIR] [--out FILE_OR_DIR]
        [--show] [--show-dir DIR] [--wait-time S] [--tta] [--allow-partial]
        [--cfg-options k=v ...] [--launcher pytorch]

Every tensor of the model must come from CHECKPOINT with its shape; otherwise the
checkpoint is refused (exit status 1) with what is missing, what the file holds and
the fix. ``--allow-partial`` evaluates a partial match on purpose.

The library is chosen by the config's ``default_scope``. Library conventions
are kept:

* ``--out``: mmdet dumps predictions to a ``.pkl`` file; mmseg writes
  prediction PNGs into a directory (``test_evaluator.output_dir``).
* ``--show-dir``: mmdet saves painted images to
  ``work_dir/<timestamp>/<show-dir>`` (an absolute path is used as is); mmseg
  makes it the visualizer's ``save_dir`` (images in ``<show-dir>/vis_data/vis_image``;
  like mmseg's own tool, only every ``default_hooks.visualization.interval``-th
  image is drawn, 50 by default).
* ``--tta``: the config's ``tta_model`` and ``tta_pipeline``, or the
  library's defaults where the config has none: mmdet's flip / no-flip TTA
  (masks are merged too, by ``visattn_mm.engine.det_tta.InstanceAwareDetTTAModel``) and mmseg's
  ``SegTTAModel`` over image ratios 0.5-1.75 x flip / no flip.
"""

from __future__ import annotations

import argparse
import copy
import os
import os.path as osp

from mmengine.config import Config, ConfigDict, DictAction
from mmengine.dist import is_main_process

from visattn_mm import cli as common


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Test a visattn_mm model')
    parser.add_argument('config', help='test config file path')
    parser.add_argument('checkpoint', help='checkpoint file')
    parser.add_argument('--work-dir', help='directory for logs and metric json')
    parser.add_argument('--out', help='mmdet: .pkl file for the raw predictions; mmseg: directory for prediction PNGs')
    parser.add_argument('--show', action='store_true', help='display predictions')
    parser.add_argument('--show-dir', help='save painted predictions here')
    parser.add_argument('--wait-time', type=float, default=2, help='seconds each --show window stays open')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction, help='override config entries, key=value (key="[a,b]" for lists)'
    )
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none', help='job launcher')
    parser.add_argument('--tta', action='store_true', help='test-time augmentation')
    parser.add_argument(
        '--allow-partial',
        action='store_true',
        help='evaluate even if some tensors of the model are not in the checkpoint '
        '(they keep their initial, random values; the log lists them)',
    )
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    common.set_local_rank_env(args.local_rank)
    return args


def apply_visualization(cfg: Config, scope: str, args: argparse.Namespace) -> None:
    """Turn on the ``visualization`` hook the way each library's test.py does."""
    hook = cfg.get('default_hooks', {}).get('visualization')
    if hook is None:
        raise SystemExit(
            '--show/--show-dir need default_hooks.visualization '
            '(DetVisualizationHook or SegVisualizationHook) in the config'
        )
    hook['draw'] = True
    if args.show:
        hook['show'] = True
        hook['wait_time'] = args.wait_time
    if args.show_dir:
        if scope == 'mmdet':
            hook['test_out_dir'] = args.show_dir
        else:
            cfg.visualizer['save_dir'] = args.show_dir


def pictures_dir(scope: str, show_dir: str, work_dir: str, timestamp: str) -> str:
    """Where ``--show-dir`` puts the painted images, by each library's convention (see the module docstring).

    Args:
        scope (str): ``'mmdet'`` or ``'mmseg'``.
        show_dir (str): The ``--show-dir`` argument.
        work_dir (str): The run's work dir.
        timestamp (str): The run's timestamp (the Runner's ``timestamp``).
    """
    if scope == 'mmdet':
        return osp.join(work_dir, timestamp, show_dir)  # an absolute show_dir stays as it is
    return osp.join(show_dir, 'vis_data', 'vis_image')


def _test_pipeline(cfg: Config) -> list:
    """A copy of the test dataset's pipeline, looking through dataset wrappers."""
    dataset = cfg.test_dataloader.dataset
    while 'dataset' in dataset:
        dataset = dataset['dataset']
    return copy.deepcopy(dataset.pipeline)


def _default_det_tta_pipeline(cfg: Config) -> list:
    """mmdet's default: the test pipeline with its packing step replaced by flip / no flip."""
    pipeline = _test_pipeline(cfg)
    pipeline[-1] = dict(
        type='TestTimeAug',
        transforms=[
            [dict(type='RandomFlip', prob=1.0), dict(type='RandomFlip', prob=0.0)],
            [
                dict(
                    type='PackDetInputs',
                    meta_keys=(
                        'img_id',
                        'img_path',
                        'ori_shape',
                        'img_shape',
                        'scale_factor',
                        'flip',
                        'flip_direction',
                    ),
                )
            ],
        ],
    )
    return pipeline


# The image ratios of mmseg's own ADE20K / Cityscapes tta_pipeline.
SEG_TTA_RATIOS = (0.5, 0.75, 1.0, 1.25, 1.5, 1.75)


def _default_seg_tta_pipeline(cfg: Config) -> list:
    """mmseg's multi-scale + flip TTA, built around the config's test pipeline.

    As in mmseg's dataset bases: the image loader, then every combination of a
    rescale of the original image by one of ``SEG_TTA_RATIOS`` and flip / no
    flip, followed by the test pipeline's remaining non-resize steps.
    """
    loader, *rest = _test_pipeline(cfg)
    return [
        loader,
        dict(
            type='TestTimeAug',
            transforms=[
                [dict(type='Resize', scale_factor=r, keep_ratio=True) for r in SEG_TTA_RATIOS],
                [
                    dict(type='RandomFlip', prob=0.0, direction='horizontal'),
                    dict(type='RandomFlip', prob=1.0, direction='horizontal'),
                ],
                *([t] for t in rest if t['type'] != 'Resize'),
            ],
        ),
    ]


DEFAULT_TTA_MODELS = {
    'mmdet': dict(
        type='InstanceAwareDetTTAModel', tta_cfg=dict(nms=dict(type='nms', iou_threshold=0.5), max_per_img=100)
    ),
    'mmseg': dict(type='SegTTAModel'),
}
DEFAULT_TTA_PIPELINES = {'mmdet': _default_det_tta_pipeline, 'mmseg': _default_seg_tta_pipeline}


def apply_tta(cfg: Config, scope: str) -> None:
    """Wrap the model in the config's ``tta_model`` and test with ``tta_pipeline``.

    Either one the config lacks gets the library's default: mmdet's flip TTA
    (merged by ``InstanceAwareDetTTAModel``, which also merges masks) or
    mmseg's multi-scale + flip TTA with ``SegTTAModel``.
    """
    if 'tta_model' not in cfg:
        cfg.tta_model = copy.deepcopy(DEFAULT_TTA_MODELS[scope])
    if 'tta_pipeline' not in cfg:
        cfg.tta_pipeline = DEFAULT_TTA_PIPELINES[scope](cfg)
    cfg.model = ConfigDict(**cfg.tta_model, module=cfg.model)
    cfg.test_dataloader.dataset.pipeline = cfg.tta_pipeline


def main(argv=None) -> None:
    args = parse_args(argv)
    common.import_plugin()
    cfg = common.load_config(args.config, args.cfg_options, args.launcher)
    scope = common.register_scope_modules(cfg)
    common.set_work_dir(cfg, args.work_dir, args.config)
    cfg.load_from = args.checkpoint
    common.check_model(cfg, scope)
    common.check_data(cfg, ('test_dataloader', 'test_evaluator'))
    if args.allow_partial:
        cfg.load_from_allow_partial = True
    if args.show or args.show_dir:
        apply_visualization(cfg, scope, args)
    if args.tta:
        apply_tta(cfg, scope)
    if args.out is not None and scope == 'mmdet' and not args.out.endswith(('.pkl', '.pickle')):
        raise SystemExit('--out for detection configs must end in .pkl or .pickle')
    if args.out is not None and scope == 'mmseg':
        cfg.test_evaluator['output_dir'] = args.out
        cfg.test_evaluator['keep_results'] = True
    common.prepare_cpu_distributed(cfg)
    runner = common.build_runner(cfg)
    runner.partial_load_option = 'add --allow-partial'
    if args.out is not None and scope == 'mmdet':
        from mmdet.evaluation import DumpDetResults

        runner.test_evaluator.metrics.append(DumpDetResults(out_file_path=args.out))
    with common.exit_on_checkpoint_error():
        runner.test()
    if args.show_dir and is_main_process():
        pictures = pictures_dir(scope, args.show_dir, runner.work_dir, runner.timestamp)
        count = len(os.listdir(pictures)) if osp.isdir(pictures) else 0
        print(f'[visattn_mm] painted predictions ({count} images): {pictures}', flush=True)
    common.finish_distributed()


if __name__ == '__main__':
    main()
