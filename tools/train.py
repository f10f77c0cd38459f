"""Train a detector (mmdet config) or a segmentor (mmseg config).

Usage::

    python tools/train.py CONFIG [--work-dir DIR] [--resume [CKPT]] [--amp]
        [--auto-scale-lr] [--cfg-options k=v ...] [--launcher pytorch]

The library is chosen by the config's ``default_scope``.
"""
from __future__ import annotations

import argparse

import _cli_common as common
from mmengine.config import Config, DictAction


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Train a visattn_mm model')
    parser.add_argument('config', help='train config file path')
    parser.add_argument('--work-dir', help='directory for logs and checkpoints')
    parser.add_argument(
        '--resume', nargs='?', const='auto', default=None, metavar='CHECKPOINT',
        help='resume from CHECKPOINT, or without a value from the latest '
        'checkpoint in the work dir')
    parser.add_argument('--amp', action='store_true',
                        help='automatic mixed precision (needs a GPU)')
    parser.add_argument('--auto-scale-lr', action='store_true',
                        help='scale the lr by total batch size / '
                        'auto_scale_lr.base_batch_size')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction,
        help='override config entries, key=value (e.g. train_cfg.max_iters=10, '
        'key="[a,b]" for lists)')
    parser.add_argument('--launcher', choices=['none', 'pytorch', 'slurm', 'mpi'],
                        default='none', help='job launcher')
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
        raise SystemExit(
            '--amp needs a GPU (or NPU/MLU/MUSA): mmengine\'s AmpOptimWrapper '
            'does not support CPU training. Run without --amp on this machine.')
    if cfg.optim_wrapper.get('type') == 'AmpOptimWrapper':
        print('[visattn_mm] optim_wrapper is already AmpOptimWrapper')
    cfg.optim_wrapper.type = 'AmpOptimWrapper'
    cfg.optim_wrapper.setdefault('loss_scale', 'dynamic')


def apply_auto_scale_lr(cfg: Config) -> None:
    """Turn on mmengine's lr scaling; the config must give base_batch_size."""
    auto = cfg.get('auto_scale_lr')
    if not auto or 'base_batch_size' not in auto:
        raise SystemExit(
            '--auto-scale-lr needs auto_scale_lr=dict(enable=False, '
            'base_batch_size=N) in the config (N = the batch size the lr was '
            'tuned for, summed over GPUs).')
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
    common.register_scope_modules(cfg)
    common.set_work_dir(cfg, args.work_dir, args.config)
    if args.amp:
        apply_amp(cfg)
    if args.auto_scale_lr:
        apply_auto_scale_lr(cfg)
    apply_resume(cfg, args.resume)
    common.prepare_cpu_distributed(cfg)
    runner = common.build_runner(cfg)
    runner.train()
    common.finish_distributed()


if __name__ == '__main__':
    main()
