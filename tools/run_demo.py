"""The demo: toy COCO data -> Mask R-CNN ViL-T training -> COCO evaluation -> a picture.

Everything runs through the user-facing tools (``tools/train.py``, ``tools/test.py``)
in subprocesses, exactly as a user would type them. Training does not validate;
afterwards the trained model is evaluated once, and the untrained model (same
config, initial weights) once, so the learning signal is visible.

Writes into ``--work-dir`` (default ``work_dirs/demo``): the training logs and
checkpoint, ``predictions.pkl`` (the trained model's validation predictions),
``demo.png`` (ground truth next to predictions on the first validation images,
and the training-loss curve) and ``summary.json`` (AP of the trained and the
untrained model, training and evaluation times).
"""

import argparse
import contextlib
import json
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

from visattn_mm.analysis import training_curves
from visattn_mm.toy_data import make_coco_instances

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / 'configs' / 'demo' / 'maskrcnn_vil_t_toy.py'
DATA_ROOT = ROOT / 'data' / 'toy_coco'
METRIC = re.compile(r'coco/(bbox|segm)_mAP(_50)?: (-?[0-9.]+)')
# Training without the config's validation: the demo evaluates once, afterwards.
NO_VALIDATION = ['val_cfg=None', 'val_dataloader=None', 'val_evaluator=None']
# Upscaling of the 160x128 toy images in the picture.
IMAGE_ZOOM = 2.5
# Drawn predictions covered by a better one over more than this share of the smaller box
# are left out.
DRAW_OVERLAP_THR = 0.5


# mmengine's training progress lines, e.g. "Iter(train) [ 10/150]  base_lr: ...".
TRAIN_PROGRESS = re.compile(r'Iter\(train\) \[\s*(\d+)/(\d+)\]')
# Lines of a failed stage's log shown on the console.
FAILURE_TAIL = 20


class Console:
    """The demo's console: one line per stage (updated in place on a terminal while training runs), the
    whole output of each stage in a log file that the line names.

    Args:
        stages (int): How many stages the demo has (the lines count them).
        stream (io.TextIOBase, optional): Where the lines go. Default: ``sys.stdout``.
    """

    def __init__(self, stages, stream=None):
        self.stages, self.stream, self.done = stages, stream or sys.stdout, 0
        self.live = self.stream.isatty()
        self.title, self.began = '', time.time()

    def start(self, title):
        """Begin the next stage's line with its title."""
        self.done += 1
        self.title, self.began = f'[{self.done}/{self.stages}] {title} ...', time.time()
        self._write(self.title)

    def progress(self, text):
        """Show how far the stage is, on a terminal only (elsewhere each update would add to the line)."""
        if self.live:
            self._write(f'\r\033[K{self.title} {text}')

    def finish(self, result):
        """End the stage's line with its result and time."""
        prefix = f'\r\033[K{self.title}' if self.live else ''
        self._write(f'{prefix} {result} ({time.time() - self.began:.0f} s)\n')

    def _write(self, text):
        self.stream.write(text)
        self.stream.flush()


def run(cmd, log_path, console):
    """Run a command with its whole output going to ``log_path`` (the command first); the console shows
    the training iterations it reaches. On failure, exit with the log's last lines and its path."""
    with open(log_path, 'w') as log:
        log.write('$ ' + ' '.join(map(str, cmd)) + '\n')
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            reached = TRAIN_PROGRESS.search(line)
            if reached:
                console.progress(f'iteration {reached.group(1)}/{reached.group(2)}')
    if proc.wait():
        tail = ''.join(Path(log_path).read_text().splitlines(keepends=True)[-FAILURE_TAIL:])
        console.finish('FAILED')
        sys.exit(f'{tail}\ncommand failed ({proc.returncode}); its whole output: {log_path}')
    return Path(log_path).read_text()


@contextlib.contextmanager
def output_into(log_path):
    """The block's printed output and warnings into ``log_path``; the mmengine logger's lines below
    ERROR left out (it writes to the stream it was created with, the console)."""
    import logging

    from mmengine.logging import MMLogger

    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(logging.ERROR)
    with open(log_path, 'a') as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        try:
            yield
        finally:
            logger.setLevel(level)


def parse_metrics(output):
    metrics = {}
    for kind, suffix, value in METRIC.findall(output):
        metrics[f'{kind}_mAP{suffix}'] = float(value)
    if 'bbox_mAP' not in metrics:
        sys.exit('no COCO metrics found in the test output')
    return metrics


def schedule_options(max_iters, warmup_iters, logger_interval):
    """``--cfg-options`` that shorten or lengthen the demo config's schedule to ``max_iters``.

    The config derives its LR milestones (75% and 90%) and checkpoint interval from
    its own ``max_iters``; these follow the new length. The warm-up and the logging
    interval are capped at the new length.
    """
    milestones = [int(max_iters * 0.75), int(max_iters * 0.9)]
    return [
        f'train_cfg.max_iters={max_iters}',
        f'param_scheduler.0.end={min(warmup_iters, max_iters)}',
        f'param_scheduler.1.end={max_iters}',
        f'param_scheduler.1.milestones=[{milestones[0]},{milestones[1]}]',
        f'default_hooks.checkpoint.interval={max_iters}',
        f'default_hooks.logger.interval={min(logger_interval, max_iters)}',
    ]


def save_untrained_checkpoint(cfg, path):
    """The model exactly as training starts it (same config, initial weights)."""
    import torch
    from mmdet.registry import MODELS
    from mmengine.registry import init_default_scope

    import visattn_mm  # noqa: F401

    init_default_scope('mmdet')
    torch.manual_seed(0)
    model = MODELS.build(cfg.model)
    model.init_weights()
    torch.save({'state_dict': model.state_dict(), 'meta': {}}, path)


def visible_predictions(pred_instances, score_thr, overlap_thr=DRAW_OVERLAP_THR):
    """The predictions drawn, best first: those scoring at least ``score_thr``, less those
    covered by a better-scoring drawn one (of any class) by more than ``overlap_thr`` of
    the smaller box's area.

    The detector's own NMS works per class at IoU 0.5, so a briefly trained model
    still stacks several boxes, nested ones too, on one object; the picture shows the
    best of them.
    """
    import torch

    boxes, scores = pred_instances['bboxes'].float(), pred_instances['scores']
    order = [i for i in scores.argsort(descending=True).tolist() if scores[i] >= score_thr]
    top_left = torch.maximum(boxes[:, None, :2], boxes[None, :, :2])
    bottom_right = torch.minimum(boxes[:, None, 2:], boxes[None, :, 2:])
    intersection = (bottom_right - top_left).clamp(min=0).prod(dim=-1)
    areas = (boxes[:, 2:] - boxes[:, :2]).clamp(min=0).prod(dim=-1)
    covered = intersection / torch.minimum(areas[:, None], areas[None, :]).clamp(min=1e-6)
    keep = []
    for i in order:
        if all(covered[i, j] <= overlap_thr for j in keep):
            keep.append(i)
    return [
        dict(
            bbox=pred_instances['bboxes'][i].tolist(),
            label=int(pred_instances['labels'][i]),
            score=float(scores[i]),
            mask=pred_instances['masks'][i],
        )
        for i in keep
    ]


def _draw_instances(ax, image, instances, classes, palette):
    """The image with each instance's mask outline, box and label (and ``score`` if present).

    Outlines rather than filled masks keep the shapes' own colours visible.
    """
    import numpy as np
    from matplotlib.patches import Rectangle
    from pycocotools import mask as mask_utils

    ax.imshow(image)
    for inst in instances:
        colour = np.array(palette[inst['label']]) / 255
        ax.contour(mask_utils.decode(inst['mask']), levels=[0.5], colors=[colour], linewidths=1.2)
        x1, y1, x2, y2 = inst['bbox']
        ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, edgecolor=colour, linewidth=1, linestyle='--'))
        text = classes[inst['label']] + (f' {inst["score"]:.2f}' if 'score' in inst else '')
        ax.text(
            x1 + 1,
            y1 + 1,
            text,
            fontsize=7,
            color='white',
            va='top',
            clip_on=True,
            bbox=dict(facecolor=colour, edgecolor='none', pad=1, alpha=0.8),
        )
    ax.set_xlim(-0.5, image.shape[1] - 0.5)  # boxes reaching past the border do not shrink the image
    ax.set_ylim(image.shape[0] - 0.5, -0.5)
    ax.set_xticks([])
    ax.set_yticks([])


def _ground_truth(coco, image_id, height, width):
    """The annotations of one image as instances (``bbox`` as x1, y1, x2, y2; ``mask`` as RLE)."""
    from pycocotools import mask as mask_utils

    label_of = {cat_id: i for i, cat_id in enumerate(sorted(coco.getCatIds()))}
    instances = []
    for ann in coco.loadAnns(coco.getAnnIds(imgIds=[image_id])):
        x, y, w, h = ann['bbox']
        rles = mask_utils.frPyObjects(ann['segmentation'], height, width)
        instances.append(
            dict(
                bbox=[x, y, x + w, y + h],
                label=label_of[ann['category_id']],
                mask=mask_utils.merge(rles) if isinstance(rles, list) else rles,
            )
        )
    return instances


def draw_demo_picture(predictions, ann_file, work_dir, out, classes, palette, score_thr, num_images=6, title=''):
    """Ground truth next to predictions on the first validation images, and the loss curve.

    Args:
        predictions (list[dict]): ``tools/test.py --out`` results (mmdet's
            ``DumpDetResults``: ``img_id``, ``img_path``, ``pred_instances`` with
            RLE masks), in any order.
        ann_file (Path): The validation annotations (COCO json).
        work_dir (Path): The training work dir; its ``vis_data/scalars.json``
            give the loss curve.
        out (Path): PNG to write.
        classes (Sequence[str]): Class names, by label.
        palette (Sequence[tuple]): RGB colour per label.
        score_thr (float): Predictions scoring below it are not drawn.
        num_images (int): Validation images shown, the first by image id.
        title (str): Figure title.
    """
    import matplotlib

    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt
    import numpy as np
    from PIL import Image
    from pycocotools.coco import COCO

    coco = COCO(str(ann_file))
    by_id = {p['img_id']: p for p in predictions}
    image_ids = sorted(by_id)[:num_images]
    pairs_per_row = 2
    rows = -(-len(image_ids) // pairs_per_row)
    first = Image.open(ROOT / by_id[image_ids[0]]['img_path'])
    panel_w, panel_h = (s * IMAGE_ZOOM / 100 for s in first.size)
    fig = plt.figure(figsize=(2 * pairs_per_row * panel_w + 6, rows * (panel_h + 0.5) + 0.8))
    grid = fig.add_gridspec(rows, 2 * pairs_per_row + 1, width_ratios=[panel_w] * 2 * pairs_per_row + [6])
    for n, image_id in enumerate(image_ids):
        row, pair = divmod(n, pairs_per_row)
        result = by_id[image_id]
        image = np.asarray(Image.open(ROOT / result['img_path']).convert('RGB'))
        height, width = image.shape[:2]
        truth_ax = fig.add_subplot(grid[row, 2 * pair])
        _draw_instances(truth_ax, image, _ground_truth(coco, image_id, height, width), classes, palette)
        truth_ax.set_title(f'ground truth: {Path(result["img_path"]).name}', fontsize=9)
        pred_ax = fig.add_subplot(grid[row, 2 * pair + 1])
        _draw_instances(pred_ax, image, visible_predictions(result['pred_instances'], score_thr), classes, palette)
        pred_ax.set_title(f'prediction (score >= {score_thr:g}; best of overlapping boxes)', fontsize=9)
    curve_ax = fig.add_subplot(grid[:, -1])
    series, validation_keys = training_curves.read_series(training_curves.find_scalar_files(work_dir))
    training_curves.draw_panel(curve_ax, series, 'loss', validation_keys)
    curve_ax.set_title('training loss (vis_data/scalars.json)', fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f'must be an int >= 1, got {text}')
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--work-dir', default='work_dirs/demo')
    parser.add_argument('--seed', type=int, default=0, help='seed of the data and of training')
    parser.add_argument(
        '--max-iters',
        type=_positive_int,
        help="training iterations (the config's 150 by default); the LR schedule and the checkpoint follow",
    )
    parser.add_argument(
        '--score-thr',
        type=float,
        default=0.5,
        help='predictions scoring below this are not drawn (all count for the AP); '
        'of boxes covering each other by more than half the smaller one, only the best',
    )
    parser.add_argument('--num-images', type=_positive_int, default=6, help='validation images in demo.png')
    parser.add_argument(
        '--cfg-options',
        nargs='+',
        default=[],
        help='extra key=value overrides for training, e.g. optim_wrapper.optimizer.lr=1e-4',
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    from mmengine.config import Config

    cfg = Config.fromfile(CONFIG)
    schedule = (
        []
        if args.max_iters is None
        else schedule_options(args.max_iters, cfg.param_scheduler[0]['end'], cfg.default_hooks.logger.interval)
    )
    work_dir = (ROOT / args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)

    console = Console(stages=5)
    console.start(f'toy COCO data in {DATA_ROOT.relative_to(ROOT)}')
    demo_log = work_dir / 'demo.log'
    demo_log.write_text('')
    with output_into(demo_log):
        make_coco_instances(DATA_ROOT, seed=args.seed)
    console.finish('ready')

    iters = args.max_iters or cfg.train_cfg.max_iters
    console.start(f'training {iters} iterations with tools/train.py')
    start = time.time()
    run(
        [
            sys.executable,
            'tools/train.py',
            CONFIG,
            '--work-dir',
            work_dir,
            '--cfg-options',
            f'randomness.seed={args.seed}',
            *NO_VALIDATION,
            *schedule,
            *args.cfg_options,
        ],
        work_dir / 'train.log',
        console,
    )
    train_minutes = (time.time() - start) / 60
    checkpoint = (work_dir / 'last_checkpoint').read_text().strip()
    console.finish(f'log: {work_dir / "train.log"}')

    console.start('evaluating the untrained model with tools/test.py')
    untrained = work_dir / 'untrained.pth'
    with output_into(demo_log):
        save_untrained_checkpoint(cfg, untrained)
    before = parse_metrics(
        run(
            [sys.executable, 'tools/test.py', CONFIG, untrained, '--work-dir', work_dir / 'untrained_eval'],
            work_dir / 'test_untrained.log',
            console,
        )
    )
    console.finish(f'bbox mAP {before["bbox_mAP"]:.3f}; log: {work_dir / "test_untrained.log"}')

    console.start('evaluating the trained model with tools/test.py')
    start = time.time()
    predictions_file = work_dir / 'predictions.pkl'
    after = parse_metrics(
        run(
            [
                sys.executable,
                'tools/test.py',
                CONFIG,
                checkpoint,
                '--work-dir',
                work_dir / 'eval',
                '--out',
                predictions_file,
            ],
            work_dir / 'test.log',
            console,
        )
    )
    test_minutes = (time.time() - start) / 60
    console.finish(f'bbox mAP {after["bbox_mAP"]:.3f}; log: {work_dir / "test.log"}')

    console.start('drawing the picture')
    with open(predictions_file, 'rb') as f:
        predictions = pickle.load(f)
    picture = work_dir / 'demo.png'
    with output_into(demo_log):
        draw_demo_picture(
            predictions,
            DATA_ROOT / 'annotations' / 'instances_val.json',
            work_dir,
            picture,
            cfg.metainfo['classes'],
            cfg.metainfo['palette'],
            args.score_thr,
            args.num_images,
            title=f'Mask R-CNN ViL-T after {iters} iterations on the toy data: bbox mAP {after["bbox_mAP"]:.3f}, '
            f'segm mAP {after.get("segm_mAP", float("nan")):.3f} (untrained: {before["bbox_mAP"]:.3f})',
        )
    console.finish(str(picture))

    summary = dict(
        trained=after,
        untrained=before,
        max_iters=iters,
        train_minutes=round(train_minutes, 1),
        trained_eval_minutes=round(test_minutes, 1),
        score_thr=args.score_thr,
        config=str(CONFIG.relative_to(ROOT)),
        seed=args.seed,
    )
    (work_dir / 'summary.json').write_text(json.dumps(summary, indent=2))
    print('\n=== demo summary ===')
    for name, m in (('untrained', before), ('trained', after)):
        print(
            f'{name:>9}: bbox mAP {m["bbox_mAP"]:.3f} (AP50 {m.get("bbox_mAP_50", float("nan")):.3f}), '
            f'segm mAP {m.get("segm_mAP", float("nan")):.3f}'
        )
    print(
        f'training ({iters} iterations, no validation inside) took {train_minutes:.1f} min, '
        f'evaluating the trained model {test_minutes:.1f} min; picture: {picture}'
    )
    print(f'logs: {work_dir}/train.log, test_untrained.log, test.log; the rest (data, picture): {demo_log}')


if __name__ == '__main__':
    main()
