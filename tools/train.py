"""Train a detector (mmdet config) or a segmentor (mmseg config).

Usage::

    python tools/train.py CONFIG [--work-dir DIR] [--resume [CKPT]] [--amp]
        [--auto-scale-lr] [--cfg-options k=v ...] [--launcher pytorch]

The library is chosen by the config's ``default_scope``.
"""

from __future__ import annotations

import argparse

import torch
from mmengine.config import Config, DictAction

from visattn_mm import cli as common
from visattn_mm.env_report import format_env, plugin_env


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Train a visattn_mm model')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='directory for logs and checkpoints')
    parser.add_argument(
        '--resume',
        nargs='?',
        const='auto',
        default=None,
        metavar='CHECKPOINT',
        help='resume from CHECKPOINT, or without a value from the latest checkpoint in the work dir',
    )
    parser.add_argument('--amp', action='store_true', help='automatic mixed precision (needs a GPU)')
    parser.add_argument(
        '--auto-scale-lr', action='store_true', help='scale the lr by total batch size / auto_scale_lr.base_batch_size'
    )
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        action=DictAction,
        help='override config entries, key=value (e.g. train_cfg.max_iters=10, key="[a,b]" for lists)',
    )
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'], default='none', help='job launcher')
    # torch.distributed.launch passes --local-rank (torch >= 2) or --local_rank.
    parser.add_argument('--local_rank', '--local-rank', type=int, default=0)
    args = parser.parse_args(argv)
    common.set_local_rank_env(args.local_rank)
    return args


def apply_amp(cfg: Config) -> None:
    """Switch the optimizer wrapper to mmengine's AmpOptimWrapper.

    Raises:
        SystemExit: Without a GPU/NPU/MLU/MUSA: mmengine 0.10.7's
            AmpOptimWrapper asserts one exists, so fail early and clearly.
    """
    if not common.has_accelerator():
        raise SystemExit(f'--amp: {common.AMP_NEEDS_ACCELERATOR}')
    if cfg.optim_wrapper.get('type') == 'AmpOptimWrapper':
        print('[visattn_mm] optim_wrapper is already AmpOptimWrapper')
    cfg.optim_wrapper.type = 'AmpOptimWrapper'
    cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')


def _config_dicts(node):
    """Every dict nested in a config node (dicts and lists), the node included."""
    if isinstance(node, dict):
        yield node
        children = node.values()
    elif isinstance(node, (list, tuple)):
        children = node
    else:
        return
    for child in children:
        yield from _config_dicts(child)


def refuse_bf16_focal_loss(cfg: Config, on_cuda: bool) -> None:
    """Stop bfloat16 AMP with a sigmoid FocalLoss before it fails mid-training.

    On CUDA, mmdet 3.3's ``FocalLoss`` computes index-label targets with mmcv's
    compiled ``sigmoid_focal_loss``, which has float32 and float16 kernels but
    none for bfloat16 (on CPU mmdet uses its pure-PyTorch path, which works).

    Args:
        cfg: The config, after ``--amp`` has been applied.
        on_cuda: Whether training runs on a CUDA GPU (injectable for tests).

    Raises:
        SystemExit: For AmpOptimWrapper with ``dtype='bfloat16'``, a sigmoid
            FocalLoss in the model, and a CUDA GPU.
    """
    wrapper = cfg.get('optim_wrapper') or {}
    dtype = str(wrapper.get('dtype')).replace('torch.', '')
    if not on_cuda or wrapper.get('type') != 'AmpOptimWrapper' or dtype != 'bfloat16':
        return
    if any(
        d.get('type') in ('FocalLoss', 'mmdet.FocalLoss')
        and d.get('use_sigmoid', True)
        and not d.get('activated', False)
        for d in _config_dicts(cfg.get('model'))
    ):
        raise SystemExit(
            "AMP with optim_wrapper.dtype='bfloat16' cannot train this model on a GPU: its "
            "FocalLoss calls mmcv's sigmoid_focal_loss CUDA kernel, which has no bfloat16 "
            "version. Use optim_wrapper.dtype='float16' (or leave dtype unset) with --amp, "
            'or train without --amp.'
        )


def apply_auto_scale_lr(cfg: Config) -> None:
    """Turn on mmengine's lr scaling; the config must give base_batch_size."""
    auto = cfg.get('auto_scale_lr')
    if not auto or 'base_batch_size' not in auto:
        raise SystemExit(
            '--auto-scale-lr needs auto_scale_lr=dict(enable=False, '
            'base_batch_size=N) in the config (N = the batch size the lr was '
            'tuned for, summed over GPUs).'
        )
    auto.enable = True


def apply_resume(cfg: Config, resume: str | None) -> None:
    """``--resume`` alone: latest checkpoint in work_dir; with a path: that one."""
    if resume is None:
        return
    cfg.resume = True
    # load_from=None makes the Runner search work_dir for the last checkpoint.
    cfg.load_from = None if resume == 'auto' else resume


def main(argv=None) -> None:
    args = parse_args(argv)
    common.import_plugin()
    cfg = common.load_config(args.config, args.cfg_options, args.launcher)
    scope = common.register_scope_modules(cfg)
    common.set_work_dir(cfg, args.work_dir, args.config)
    if args.amp:
        apply_amp(cfg)
    common.check_amp_device(cfg)
    refuse_bf16_focal_loss(cfg, on_cuda=torch.cuda.is_available())
    common.check_model(cfg, scope)
    validation = ('val_dataloader', 'val_evaluator') if cfg.get('val_cfg') else ()
    common.check_data(cfg, ('train_dataloader', *validation))
    if args.auto_scale_lr:
        apply_auto_scale_lr(cfg)
    apply_resume(cfg, args.resume)
    common.prepare_cpu_distributed(cfg)
    runner = common.build_runner(cfg)
    runner.logger.info('visattn_mm environment:\n' + format_env(plugin_env()))
    common.keep_config_in_log_dir(runner)
    with common.exit_on_checkpoint_error():
        runner.train()
    common.finish_distributed()


if __name__ == '__main__':
    main()
