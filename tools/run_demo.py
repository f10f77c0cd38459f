"""The demo: toy COCO data -> Mask R-CNN ViL-T training -> COCO evaluation -> pictures.

Everything runs through the user-facing tools (``tools/train.py``, ``tools/test.py``)
in subprocesses, exactly as a user would type them. The untrained model (same
config, initial weights) is evaluated too, so the learning signal is visible.

Writes into ``--work-dir`` (default ``work_dirs/demo``): the training logs and
checkpoint, ``prediction.png`` (predictions on a validation image) and
``summary.json`` (AP of the trained and the untrained model, training time).
"""
import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))

from make_toy_data import make_coco_instances  # noqa: E402

CONFIG = ROOT / 'configs' / 'demo' / 'maskrcnn_vil_t_toy.py'
METRIC = re.compile(r'coco/(bbox|segm)_mAP(_50)?: (-?[0-9.]+)')


def run(cmd, log_path):
    """Run a command, echo its output, keep a copy, and fail loudly."""
    print('$', ' '.join(map(str, cmd)), flush=True)
    with open(log_path, 'w') as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
    if proc.wait():
        sys.exit(f'command failed ({proc.returncode}); see {log_path}')
    return Path(log_path).read_text()


def parse_metrics(output):
    metrics = {}
    for kind, suffix, value in METRIC.findall(output):
        metrics[f'{kind}_mAP{suffix}'] = float(value)
    if 'bbox_mAP' not in metrics:
        sys.exit('no COCO metrics found in the test output')
    return metrics


def save_untrained_checkpoint(path):
    """The model exactly as training starts it (same config, initial weights)."""
    import torch
    from mmengine.config import Config
    from mmengine.registry import init_default_scope

    import visattn_mm  # noqa: F401
    from mmdet.registry import MODELS

    cfg = Config.fromfile(CONFIG)
    init_default_scope('mmdet')
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    model.init_weights()
    torch.save({'state_dict': model.state_dict(), 'meta': {}}, path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--work-dir', default='work_dirs/demo')
    parser.add_argument('--seed', type=int, default=0, help='seed of the data and of training')
    parser.add_argument('--cfg-options', nargs='+', default=[],
                        help='extra key=value overrides for training, e.g. train_cfg.max_iters=300')
    args = parser.parse_args()
    work_dir = (ROOT / args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)

    make_coco_instances(ROOT / 'data' / 'toy_coco', seed=args.seed)

    start = time.time()
    run([sys.executable, 'tools/train.py', CONFIG, '--work-dir', work_dir,
         '--cfg-options', f'randomness.seed={args.seed}', *args.cfg_options], work_dir / 'train.log')
    train_minutes = (time.time() - start) / 60
    checkpoint = (work_dir / 'last_checkpoint').read_text().strip()

    untrained = work_dir / 'untrained.pth'
    save_untrained_checkpoint(untrained)
    before = parse_metrics(run([sys.executable, 'tools/test.py', CONFIG, untrained,
                                '--work-dir', work_dir / 'untrained_eval'], work_dir / 'test_untrained.log'))
    after = parse_metrics(run([sys.executable, 'tools/test.py', CONFIG, checkpoint, '--work-dir', work_dir,
                               '--show-dir', 'vis'], work_dir / 'test.log'))

    pictures = sorted(work_dir.glob('*/vis/*.png')) + sorted(work_dir.glob('*/vis/*.jpg'))
    if not pictures:
        sys.exit('tools/test.py --show-dir wrote no pictures')
    shutil.copy(pictures[-1], work_dir / 'prediction.png')

    summary = dict(trained=after, untrained=before, train_minutes=round(train_minutes, 1),
                   config=str(CONFIG.relative_to(ROOT)), seed=args.seed)
    (work_dir / 'summary.json').write_text(json.dumps(summary, indent=2))
    print('\n=== demo summary ===')
    for name, m in (('untrained', before), ('trained', after)):
        print(f'{name:>9}: bbox mAP {m["bbox_mAP"]:.3f} (AP50 {m.get("bbox_mAP_50", float("nan")):.3f}), '
              f'segm mAP {m.get("segm_mAP", float("nan")):.3f}')
    print(f'training took {train_minutes:.1f} min; predictions drawn in {work_dir / "prediction.png"}')


if __name__ == '__main__':
    main()
