"""Generate tiny synthetic datasets for smoke-testing detection and segmentation.

Two layouts are produced, both deterministic given a seed:

* ``coco``: COCO-format instance segmentation of simple shapes
  (``circle``, ``square``, ``triangle``; category ids 1..3)::

      out_dir/train/000000.png ...
      out_dir/val/000000.png ...
      out_dir/annotations/instances_train.json
      out_dir/annotations/instances_val.json

* ``ade20k``: ADE20K-style semantic segmentation::

      out_dir/images/training/000000.jpg ...
      out_dir/images/validation/000000.jpg ...
      out_dir/annotations/training/000000.png ...
      out_dir/annotations/validation/000000.png ...

  Label PNGs are uint8 with ``0`` = background, which ADE20K treats as
  "ignore" (load with ``reduce_zero_label=True``), and ``1..K`` = the shape
  classes of :data:`ADE_CLASSES` (K = 4). After the zero-label reduction the
  model sees classes ``0..K-1`` in the order of :data:`ADE_CLASSES`.

Each output directory gets a ``toy_manifest.json`` written last; a rerun with
the same kind, version, seed, counts and size is a no-op.

The command line is ``tools/make_toy_data.py`` (:func:`main`)::

    python tools/make_toy_data.py coco data/toy_coco [--seed 0] [--num-train 200]
    python tools/make_toy_data.py ade20k data/toy_ade [--seed 0]
    # detection-size images (shapes scale with the image), e.g. for training throughput:
    python tools/make_toy_data.py coco data/toy_coco_det --image-size 800 1333 --num-train 16 --num-val 2

:func:`use_toy_data` points an mmdet or mmseg config at such a dataset, keeping
its pipelines, model and schedule; :func:`write_toy_config` (``--config``) writes the result as a
config file that ``tools/train.py`` and ``tools/test.py`` run unchanged::

    python tools/make_toy_data.py coco data/toy_coco_det --image-size 800 1333 --num-train 8 --num-val 4 \
        --config configs/maskrcnn_vil_s_1x.py --iters 2   # writes data/toy_coco_det/maskrcnn_vil_s_1x_toy.py
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw

#: Bump when the generator's output changes, so stale data is regenerated.
#: 2: shapes grow with images whose short side exceeds 128 (detection-size data).
TOY_DATA_VERSION = 2
MANIFEST_NAME = 'toy_manifest.json'

#: COCO classes; category id = index + 1.
COCO_CLASSES = ('circle', 'square', 'triangle')
#: ADE20K-layout classes; label value = index + 1 (0 is background/ignore).
ADE_CLASSES = ('circle', 'square', 'triangle', 'diamond')

# One base colour per shape kind (RGB). Distinct hues keep the task easy to
# learn in a few hundred CPU iterations; per-object jitter keeps it non-trivial.
_BASE_COLOURS = {
    'circle': (220, 60, 60),
    'square': (60, 200, 70),
    'triangle': (60, 90, 230),
    'diamond': (230, 200, 40),
}
_COLOUR_JITTER = 30
_CIRCLE_VERTICES = 24
# Shape diameters are drawn for a short side of up to this many pixels and scaled
# with larger images, so that e.g. 800x1333 images hold objects of COCO-like size.
_SIZE_REFERENCE_SIDE = 128


# --------------------------------------------------------------------------
# Drawing primitives
# --------------------------------------------------------------------------
def _background(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A dim random linear gradient plus Gaussian noise, as uint8 HxWx3."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    angle = rng.uniform(0, 2 * math.pi)
    ramp = np.cos(angle) * xx / width + np.sin(angle) * yy / height
    ramp = (ramp - ramp.min()) / max(float(np.ptp(ramp)), 1e-6)
    start = rng.uniform(40, 110, size=3)
    end = rng.uniform(40, 110, size=3)
    img = start + ramp[..., None] * (end - start)
    img += rng.normal(0, 8, size=img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def _shape_polygon(rng: np.random.Generator, kind: str, cx: float, cy: float, size: float) -> list[tuple[float, float]]:
    """Vertices of a shape of diameter ``size`` centred at (cx, cy)."""
    r = size / 2
    if kind == 'circle':
        angles = np.linspace(0, 2 * math.pi, _CIRCLE_VERTICES, endpoint=False)
        rot = 0.0
    elif kind == 'square':
        # Inscribed in the circle of radius r, so every kind fits the same box.
        angles = np.array([0.25, 0.75, 1.25, 1.75]) * math.pi
        rot = rng.uniform(-0.3, 0.3)
    elif kind == 'triangle':
        angles = np.array([-0.5, 1 / 6, 5 / 6]) * math.pi
        rot = rng.uniform(-0.5, 0.5)
    elif kind == 'diamond':
        angles = np.array([0.0, 0.5, 1.0, 1.5]) * math.pi
        rot = 0.0
    else:
        raise ValueError(f'unknown shape {kind!r}')
    angles = angles + rot
    # Round so the JSON and the rasterised mask describe exactly the same polygon.
    return [(round(cx + r * math.cos(a), 2), round(cy + r * math.sin(a), 2)) for a in angles]


def _jittered_colour(rng: np.random.Generator, kind: str) -> tuple[int, int, int]:
    base = np.array(_BASE_COLOURS[kind], dtype=np.int64)
    colour = base + rng.integers(-_COLOUR_JITTER, _COLOUR_JITTER + 1, size=3)
    return tuple(int(c) for c in np.clip(colour, 0, 255))


def _place_objects(
    rng: np.random.Generator,
    classes: Sequence[str],
    height: int,
    width: int,
    min_objects: int,
    max_objects: int,
    min_size: int,
    max_size: int,
) -> list[dict]:
    """Sample non-overlapping shapes; returns dicts with kind, polygon, colour.

    Shapes never overlap (rejection sampling on bounding circles), so every
    polygon equals the visible region and masks need no occlusion handling.
    Diameters lie in ``[min_size, max_size]`` for images with a short side of
    up to ``_SIZE_REFERENCE_SIDE`` and grow in proportion beyond it.
    """
    scale = max(1.0, min(height, width) / _SIZE_REFERENCE_SIDE)
    min_size, max_size = round(min_size * scale), round(max_size * scale)
    max_size = min(max_size, height - 2, width - 2)
    wanted = int(rng.integers(min_objects, max_objects + 1))
    placed: list[tuple[float, float, float]] = []
    objects = []
    for _ in range(wanted * 30):
        if len(objects) == wanted:
            break
        size = float(rng.integers(min_size, max_size + 1))
        r = size / 2
        cx = float(rng.uniform(r + 1, width - r - 1))
        cy = float(rng.uniform(r + 1, height - r - 1))
        if any(math.hypot(cx - px, cy - py) < r + pr + 2 for px, py, pr in placed):
            continue
        placed.append((cx, cy, r))
        kind_idx = int(rng.integers(len(classes)))
        kind = classes[kind_idx]
        objects.append(
            dict(label=kind_idx, polygon=_shape_polygon(rng, kind, cx, cy, size), colour=_jittered_colour(rng, kind))
        )
    if len(objects) < min_objects:  # pragma: no cover - only for absurd sizes
        raise RuntimeError('could not place objects; image too small for sizes')
    return objects


def _polygon_area(poly: Sequence[tuple[float, float]]) -> float:
    """Shoelace area of a simple polygon."""
    xs = np.array([p[0] for p in poly])
    ys = np.array([p[1] for p in poly])
    return float(0.5 * abs(np.dot(xs, np.roll(ys, -1)) - np.dot(ys, np.roll(xs, -1))))


# --------------------------------------------------------------------------
# Manifest handling
# --------------------------------------------------------------------------
def _manifest(kind: str, **params) -> dict:
    return dict(kind=kind, version=TOY_DATA_VERSION, **params)


def _is_up_to_date(out_dir: Path, manifest: dict) -> bool:
    path = out_dir / MANIFEST_NAME
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()) == manifest
    except (OSError, ValueError):
        return False


def _clear_generated(directory: Path) -> None:
    """Delete files an earlier run wrote (``NNNNNN.png/jpg``), nothing else.

    Without this a smaller rerun would leave extra images behind, and
    directory-scanning datasets (ADE20K layout) would pick them up.
    """
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        if path.suffix in ('.png', '.jpg') and path.stem.isdigit() and len(path.stem) == 6:
            path.unlink()


def _write_manifest(out_dir: Path, manifest: dict) -> None:
    # Written last: an interrupted run leaves no manifest and is redone.
    (out_dir / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _generate(out_dir: Path, manifest: dict, force: bool, write_split, splits: Sequence[tuple[str, int]]) -> Path:
    """Write a toy dataset into ``out_dir`` unless it holds one of the same ``manifest`` (or ``force``).

    ``write_split(rng, split, num_images)`` writes each ``(split, num_images)`` of ``splits``, each split
    from its own random stream of ``manifest['seed']`` (the val set does not change with num_train);
    the manifest is removed first and written last.
    """
    if not force and _is_up_to_date(out_dir, manifest):
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_NAME).unlink(missing_ok=True)
    streams = np.random.SeedSequence(manifest['seed']).spawn(len(splits))
    for stream, (split, num_images) in zip(streams, splits):
        write_split(np.random.default_rng(stream), split, num_images)
    _write_manifest(out_dir, manifest)
    return out_dir


# --------------------------------------------------------------------------
# COCO instance segmentation
# --------------------------------------------------------------------------
def _coco_split(rng: np.random.Generator, out_dir: Path, split: str, num_images: int, height: int, width: int) -> None:
    img_dir = out_dir / split
    _clear_generated(img_dir)
    img_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for img_idx in range(num_images):
        canvas = Image.fromarray(_background(rng, height, width))
        draw = ImageDraw.Draw(canvas)
        objects = _place_objects(rng, COCO_CLASSES, height, width, 1, 4, 16, 56)
        file_name = f'{img_idx:06d}.png'
        image_id = img_idx + 1
        for obj in objects:
            poly = obj['polygon']
            draw.polygon(poly, fill=obj['colour'])
            xs = [p[0] for p in poly]
            ys = [p[1] for p in poly]
            x0, y0 = min(xs), min(ys)
            annotations.append(
                dict(
                    id=len(annotations) + 1,
                    image_id=image_id,
                    category_id=obj['label'] + 1,
                    segmentation=[[c for p in poly for c in p]],
                    bbox=[round(x0, 2), round(y0, 2), round(max(xs) - x0, 2), round(max(ys) - y0, 2)],
                    area=round(_polygon_area(poly), 2),
                    iscrowd=0,
                )
            )
        canvas.save(img_dir / file_name)
        images.append(dict(id=image_id, file_name=file_name, width=width, height=height))
    coco = dict(
        info=dict(description='visattn_mm toy shapes', version=str(TOY_DATA_VERSION)),
        licenses=[],
        images=images,
        annotations=annotations,
        categories=[dict(id=i + 1, name=name, supercategory='shape') for i, name in enumerate(COCO_CLASSES)],
    )
    ann_dir = out_dir / 'annotations'
    ann_dir.mkdir(parents=True, exist_ok=True)
    (ann_dir / f'instances_{split}.json').write_text(json.dumps(coco))


def make_coco_instances(
    out_dir: str | Path,
    num_train: int = 200,
    num_val: int = 50,
    image_size: tuple[int, int] = (128, 160),
    seed: int = 0,
    force: bool = False,
) -> Path:
    """Write a COCO-format instance-segmentation toy dataset.

    Args:
        out_dir: Output directory (created if needed).
        num_train: Number of training images.
        num_val: Number of validation images.
        image_size: Image size as (height, width).
        seed: Seed of the numpy random generator; same seed, same bytes.
        force: Regenerate even if a matching manifest exists.

    Returns:
        The output directory as a :class:`~pathlib.Path`.
    """
    out_dir = Path(out_dir)
    height, width = image_size
    manifest = _manifest('coco', seed=seed, num_train=num_train, num_val=num_val, image_size=[height, width])

    def write_split(rng, split, num_images):
        _coco_split(rng, out_dir, split, num_images, height, width)

    return _generate(out_dir, manifest, force, write_split, [('train', num_train), ('val', num_val)])


# --------------------------------------------------------------------------
# ADE20K-layout semantic segmentation
# --------------------------------------------------------------------------
def _ade_split(
    rng: np.random.Generator,
    out_dir: Path,
    split: str,
    num_images: int,
    height: int,
    width: int,
    classes: Sequence[str],
) -> None:
    img_dir = out_dir / 'images' / split
    ann_dir = out_dir / 'annotations' / split
    _clear_generated(img_dir)
    _clear_generated(ann_dir)
    img_dir.mkdir(parents=True, exist_ok=True)
    ann_dir.mkdir(parents=True, exist_ok=True)
    for img_idx in range(num_images):
        canvas = Image.fromarray(_background(rng, height, width))
        label = Image.new('L', (width, height), 0)
        draw, draw_label = ImageDraw.Draw(canvas), ImageDraw.Draw(label)
        for obj in _place_objects(rng, classes, height, width, 1, 4, 20, 64):
            draw.polygon(obj['polygon'], fill=obj['colour'])
            draw_label.polygon(obj['polygon'], fill=obj['label'] + 1)
        stem = f'{img_idx:06d}'
        # High quality keeps JPEG ringing from blurring class boundaries much.
        canvas.save(img_dir / f'{stem}.jpg', quality=95)
        label.save(ann_dir / f'{stem}.png')


def make_ade20k_layout(
    out_dir: str | Path,
    num_train: int = 100,
    num_val: int = 20,
    image_size: tuple[int, int] = (128, 128),
    seed: int = 0,
    num_classes: int = len(ADE_CLASSES),
    force: bool = False,
) -> Path:
    """Write an ADE20K-layout semantic-segmentation toy dataset.

    Label maps use 0 for background (ignored under ``reduce_zero_label=True``)
    and ``1..num_classes`` for the first ``num_classes`` entries of
    :data:`ADE_CLASSES`.

    Args:
        out_dir: Output directory (created if needed).
        num_train: Number of training images.
        num_val: Number of validation images.
        image_size: Image size as (height, width).
        seed: Seed of the numpy random generator; same seed, same bytes.
        num_classes: Number of foreground classes, 1..len(ADE_CLASSES).
        force: Regenerate even if a matching manifest exists.

    Returns:
        The output directory as a :class:`~pathlib.Path`.
    """
    if not 1 <= num_classes <= len(ADE_CLASSES):
        raise ValueError(f'num_classes must be in 1..{len(ADE_CLASSES)}, got {num_classes}')
    out_dir = Path(out_dir)
    height, width = image_size
    manifest = _manifest(
        'ade20k', seed=seed, num_train=num_train, num_val=num_val, image_size=[height, width], num_classes=num_classes
    )
    classes = ADE_CLASSES[:num_classes]

    def write_split(rng, split, num_images):
        _ade_split(rng, out_dir, split, num_images, height, width, classes)

    return _generate(out_dir, manifest, force, write_split, [('training', num_train), ('validation', num_val)])


# --------------------------------------------------------------------------
# Configs on toy data
# --------------------------------------------------------------------------
def _class_heads(model) -> list:
    """The heads of an mmdet / mmseg model dict that have a ``num_classes``."""
    roi = model.get('roi_head') or {}
    heads = [
        model.get('bbox_head'),
        roi.get('bbox_head'),
        roi.get('mask_head'),
        model.get('decode_head'),
        model.get('auxiliary_head'),
    ]
    flat = []
    for head in heads:
        flat += head if isinstance(head, (list, tuple)) else [head]
    return [head for head in flat if head is not None and 'num_classes' in head]


def use_toy_data(cfg, data_root: str | Path) -> None:
    """Point an mmdet or mmseg config at a toy dataset, in place.

    Pipelines, model, optimiser and schedule stay the config's own. The
    datasets of the train / val / test loaders (through dataset wrappers) read
    ``data_root``: a ``coco`` layout for ``default_scope='mmdet'``, an
    ``ade20k`` one (as ``BaseSegDataset``) for ``'mmseg'``; COCO evaluators read
    its validation annotations, and every head's ``num_classes`` becomes the
    number of toy classes.

    Args:
        cfg (mmengine.config.Config): The config to change.
        data_root: A directory written by :func:`make_coco_instances` or
            :func:`make_ade20k_layout` (with all of :data:`ADE_CLASSES`).

    Raises:
        ValueError: For a config of another library.
    """
    root = str(data_root).rstrip('/') + '/'
    scope = cfg.get('default_scope')
    if scope == 'mmdet':
        classes, splits = COCO_CLASSES, dict(train='train', val='val', test='val')

        def fields(split):
            return dict(
                data_root=root,
                ann_file=f'annotations/instances_{split}.json',
                data_prefix=dict(img=f'{split}/'),
                metainfo=dict(classes=classes),
            )
    elif scope == 'mmseg':
        classes, splits = ADE_CLASSES, dict(train='training', val='validation', test='validation')

        def fields(split):
            return dict(
                type='BaseSegDataset',
                data_root=root,
                img_suffix='.jpg',
                seg_map_suffix='.png',
                reduce_zero_label=True,
                data_prefix=dict(img_path=f'images/{split}', seg_map_path=f'annotations/{split}'),
                metainfo=dict(classes=classes),
            )
    else:
        raise ValueError(
            f"use_toy_data: default_scope={scope!r}; toy data exists for 'mmdet' "
            "(coco layout) and 'mmseg' (ade20k layout) configs"
        )
    for phase, split in splits.items():
        loader = cfg.get(f'{phase}_dataloader')
        if not loader:
            continue
        dataset = loader['dataset']
        while 'dataset' in dataset:  # RepeatDataset, ConcatDataset-like wrappers
            dataset = dataset['dataset']
        dataset.update(fields(split))
    if scope == 'mmdet':
        for key in ('val_evaluator', 'test_evaluator'):
            evaluators = cfg.get(key) or []
            for evaluator in evaluators if isinstance(evaluators, list) else [evaluators]:
                if 'ann_file' in evaluator:
                    evaluator['ann_file'] = root + 'annotations/instances_val.json'
    for head in _class_heads(cfg.model):
        head['num_classes'] = len(classes)


def write_toy_config(config: str | Path, data_root: str | Path, iters: int | None = None) -> Path:
    """Write ``config`` pointed at the toy dataset ``data_root`` (:func:`use_toy_data`) as one file.

    The file is the config with its bases resolved (mmengine's dump), so it runs anywhere the config
    runs: e.g. a real config at its real input size on toy data, before COCO or ADE20K is at hand.

    Args:
        config: An mmdet or mmseg config file (``mmdet::`` / ``mmseg::`` names too).
        data_root: The dataset's directory; the config is written there.
        iters (int, optional): Make it a short run: ``iters`` training iterations, then validation and
            a checkpoint (``iter_<iters>.pth``); no ImageNet weights and no learning-rate schedule; every
            detection kept at test time, so that an untrained model still has metrics.

    Returns:
        Path: ``<data_root>/<config name>_toy.py``.
    """
    from mmengine.config import Config

    cfg = Config.fromfile(str(config))
    use_toy_data(cfg, data_root)
    if iters is not None:
        cfg.model.backbone.init_cfg = None
        cfg.train_cfg = dict(type='IterBasedTrainLoop', max_iters=iters, val_interval=iters)
        cfg.param_scheduler = []
        cfg.default_hooks.checkpoint = dict(type='CheckpointHook', by_epoch=False, interval=iters)
        cfg.log_processor = dict(by_epoch=False)
        test_cfg = cfg.model.get('test_cfg') or {}
        for thresholds in (test_cfg, test_cfg.get('rcnn') or {}):
            if 'score_thr' in thresholds:
                thresholds['score_thr'] = 0.0
    path = Path(data_root) / f'{Path(str(config).split("::")[-1]).stem}_toy.py'
    cfg.dump(str(path))
    return path


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('kind', choices=['coco', 'ade20k'], help='dataset layout')
    parser.add_argument('out_dir', help='output directory')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--num-train', type=int, default=None, help='training images (default: 200 coco, 100 ade20k)')
    parser.add_argument('--num-val', type=int, default=None, help='validation images (default: 50 coco, 20 ade20k)')
    parser.add_argument(
        '--image-size',
        type=int,
        nargs=2,
        metavar=('H', 'W'),
        default=None,
        help='default: 128 160 coco, 128 128 ade20k',
    )
    parser.add_argument(
        '--num-classes', type=int, default=len(ADE_CLASSES), help='ade20k only: number of foreground classes'
    )
    parser.add_argument('--force', action='store_true', help='regenerate even if the manifest matches')
    parser.add_argument(
        '--config',
        action='append',
        default=[],
        help='also write this mmdet (coco) or mmseg (ade20k) config pointed at the dataset, as '
        '<out_dir>/<name>_toy.py (repeatable)',
    )
    parser.add_argument(
        '--iters', type=int, default=None, help='with --config: a short run of this many iterations (write_toy_config)'
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    kwargs = dict(seed=args.seed, force=args.force)
    # Only pass what was given, so each layout keeps its own defaults.
    if args.num_train is not None:
        kwargs['num_train'] = args.num_train
    if args.num_val is not None:
        kwargs['num_val'] = args.num_val
    if args.image_size is not None:
        kwargs['image_size'] = tuple(args.image_size)
    if args.kind == 'coco':
        out = make_coco_instances(args.out_dir, **kwargs)
    else:
        out = make_ade20k_layout(args.out_dir, num_classes=args.num_classes, **kwargs)
    print(f'toy {args.kind} dataset ready at {out}')
    for config in args.config:
        print(f'{config} on it: {write_toy_config(config, out, iters=args.iters)}')


if __name__ == '__main__':
    main()
