"""Tests for tools/make_toy_data.py: determinism, annotation sanity, loading."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mmengine.config import Config
from PIL import Image

from paths import ROOT
from visattn_mm import toy_data as toy

COCO_KW = dict(num_train=6, num_val=3)
ADE_KW = dict(num_train=5, num_val=3)


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob('*')) if p.is_file()}


@pytest.fixture(scope='module')
def coco_dir(tmp_path_factory) -> Path:
    return toy.make_coco_instances(tmp_path_factory.mktemp('coco'), **COCO_KW)


@pytest.fixture(scope='module')
def ade_dir(tmp_path_factory) -> Path:
    return toy.make_ade20k_layout(tmp_path_factory.mktemp('ade'), **ADE_KW)


# --------------------------------------------------------------------------
# Determinism and the manifest
# --------------------------------------------------------------------------
@pytest.mark.parametrize('make,kwargs', [(toy.make_coco_instances, COCO_KW), (toy.make_ade20k_layout, ADE_KW)])
def test_same_seed_same_bytes_other_seed_differs(tmp_path, make, kwargs):
    a = _tree_bytes(make(tmp_path / 'a', seed=3, **kwargs))
    b = _tree_bytes(make(tmp_path / 'b', seed=3, **kwargs))
    c = _tree_bytes(make(tmp_path / 'c', seed=4, **kwargs))
    assert a == b
    assert a.keys() == c.keys()
    data_files = [k for k in a if not k.endswith(toy.MANIFEST_NAME)]
    assert all(a[k] != c[k] for k in data_files if k.endswith(('.json', '.jpg')))


def test_rerun_with_same_manifest_is_a_no_op(tmp_path, monkeypatch):
    out = toy.make_coco_instances(tmp_path, **COCO_KW)
    before = _tree_bytes(out)

    def fail(*args, **kwargs):
        raise AssertionError('regenerated although the manifest matched')

    monkeypatch.setattr(toy, '_coco_split', fail)
    toy.make_coco_instances(tmp_path, **COCO_KW)
    assert _tree_bytes(out) == before
    with pytest.raises(AssertionError, match='regenerated'):
        toy.make_coco_instances(tmp_path, seed=1, **COCO_KW)


def test_smaller_rerun_removes_stale_images(tmp_path):
    toy.make_ade20k_layout(tmp_path, num_train=5, num_val=2)
    toy.make_ade20k_layout(tmp_path, num_train=3, num_val=2)
    assert len(list((tmp_path / 'images' / 'training').glob('*.jpg'))) == 3
    assert len(list((tmp_path / 'annotations' / 'training').glob('*.png'))) == 3
    manifest = json.loads((tmp_path / toy.MANIFEST_NAME).read_text())
    assert manifest['num_train'] == 3 and manifest['version'] == toy.TOY_DATA_VERSION


def test_cli_writes_both_layouts(tmp_path, capsys):
    toy.main(['coco', str(tmp_path / 'c'), '--num-train', '2', '--num-val', '1', '--seed', '5'])
    toy.main(['ade20k', str(tmp_path / 'a'), '--num-train', '2', '--num-val', '1', '--image-size', '64', '96'])
    manifest = json.loads((tmp_path / 'c' / toy.MANIFEST_NAME).read_text())
    assert manifest == dict(
        kind='coco', version=toy.TOY_DATA_VERSION, seed=5, num_train=2, num_val=1, image_size=[128, 160]
    )
    img = Image.open(tmp_path / 'a' / 'images' / 'training' / '000000.jpg')
    assert img.size == (96, 64)


# --------------------------------------------------------------------------
# COCO annotations
# --------------------------------------------------------------------------
def test_coco_annotations_are_consistent(coco_dir):
    from pycocotools.coco import COCO

    for split, count in (('train', COCO_KW['num_train']), ('val', COCO_KW['num_val'])):
        ann_file = coco_dir / 'annotations' / f'instances_{split}.json'
        coco = COCO(str(ann_file))
        assert [c['id'] for c in coco.loadCats(coco.getCatIds())] == [1, 2, 3]
        assert len(coco.getImgIds()) == count
        for img_info in coco.loadImgs(coco.getImgIds()):
            assert (img_info['height'], img_info['width']) == (128, 160)
            image = np.asarray(Image.open(coco_dir / split / img_info['file_name']))
            assert image.shape == (128, 160, 3) and image.dtype == np.uint8
            anns = coco.loadAnns(coco.getAnnIds(imgIds=img_info['id']))
            assert 1 <= len(anns) <= 4
            for ann in anns:
                _check_annotation(coco, ann, image)


def _check_annotation(coco, ann, image):
    x, y, w, h = ann['bbox']
    assert ann['iscrowd'] == 0 and ann['area'] > 0 and w > 0 and h > 0
    assert 0 <= x and 0 <= y and x + w <= image.shape[1] and y + h <= image.shape[0]
    (poly,) = ann['segmentation']
    xs, ys = np.array(poly[0::2]), np.array(poly[1::2])
    assert xs.min() >= x - 1e-6 and xs.max() <= x + w + 1e-6
    assert ys.min() >= y - 1e-6 and ys.max() <= y + h + 1e-6
    # The decoded mask must sit inside the box and cover the drawn shape.
    mask = coco.annToMask(ann).astype(bool)
    rows, cols = np.nonzero(mask)
    assert rows.min() >= int(y) - 1 and rows.max() <= y + h + 1
    assert cols.min() >= int(x) - 1 and cols.max() <= x + w + 1
    assert abs(mask.sum() - ann['area']) <= 0.25 * ann['area'] + 10
    # Pixels under the mask carry the class colour (jittered), not background;
    # the median ignores edge pixels the two rasterisers disagree on.
    name = coco.loadCats(ann['category_id'])[0]['name']
    median = np.median(image[mask].reshape(-1, 3).astype(float), axis=0)
    base = np.array(toy._BASE_COLOURS[name], dtype=float)
    assert np.abs(median - base).max() <= toy._COLOUR_JITTER


def test_coco_loads_through_mmdet(coco_dir):
    from mmdet.registry import DATASETS
    from mmdet.utils import register_all_modules
    from mmengine.registry import DefaultScope

    register_all_modules(init_default_scope=False)
    with DefaultScope.overwrite_default_scope('mmdet'):
        dataset = DATASETS.build(
            dict(
                type='CocoDataset',
                data_root=str(coco_dir),
                ann_file='annotations/instances_val.json',
                data_prefix=dict(img='val/'),
                metainfo=dict(classes=toy.COCO_CLASSES),
                pipeline=[
                    dict(type='LoadImageFromFile'),
                    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
                    dict(type='PackDetInputs'),
                ],
            )
        )
        assert len(dataset) == COCO_KW['num_val']
        assert dataset.metainfo['classes'] == toy.COCO_CLASSES
        raw = json.loads((coco_dir / 'annotations' / 'instances_val.json').read_text())
        first_count = sum(a['image_id'] == 1 for a in raw['annotations'])
        sample = dataset[0]
    assert tuple(sample['inputs'].shape) == (3, 128, 160)
    gt = sample['data_samples'].gt_instances
    assert len(gt) == first_count
    assert gt.masks.masks.shape == (first_count, 128, 160)
    assert gt.masks.masks.sum() > 0
    assert set(gt.labels.tolist()) <= {0, 1, 2}


# --------------------------------------------------------------------------
# ADE20K layout
# --------------------------------------------------------------------------
def test_ade_labels_use_zero_as_background(ade_dir):
    for split in ('training', 'validation'):
        labels = sorted((ade_dir / 'annotations' / split).glob('*.png'))
        images = sorted((ade_dir / 'images' / split).glob('*.jpg'))
        assert [p.stem for p in labels] == [p.stem for p in images]
        for path in labels:
            label = np.asarray(Image.open(path))
            assert label.dtype == np.uint8 and label.shape == (128, 128)
            values = set(np.unique(label).tolist())
            assert 0 in values and values - {0}
            assert values <= set(range(len(toy.ADE_CLASSES) + 1))


def test_ade_layout_loads_through_mmseg(ade_dir):
    from mmengine.registry import DefaultScope
    from mmseg.registry import DATASETS
    from mmseg.utils import register_all_modules

    register_all_modules(init_default_scope=False)
    with DefaultScope.overwrite_default_scope('mmseg'):
        dataset = DATASETS.build(
            dict(
                type='BaseSegDataset',
                data_root=str(ade_dir),
                data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
                img_suffix='.jpg',
                seg_map_suffix='.png',
                reduce_zero_label=True,
                metainfo=dict(classes=toy.ADE_CLASSES),
                pipeline=[
                    dict(type='LoadImageFromFile'),
                    dict(type='LoadAnnotations'),
                    dict(type='PackSegInputs'),
                ],
            )
        )
        assert len(dataset) == ADE_KW['num_val']
        sample = dataset[0]
    assert tuple(sample['inputs'].shape) == (3, 128, 128)
    seg = sample['data_samples'].gt_sem_seg.data
    values = set(seg.unique().tolist())
    # reduce_zero_label: background 0 -> 255 (ignored), class k -> k - 1.
    assert 255 in values and values - {255}
    assert values <= set(range(len(toy.ADE_CLASSES))) | {255}


# --------------------------------------------------------------------------
# Configs on toy data
# --------------------------------------------------------------------------
@pytest.mark.parametrize(
    'config,layout', [('maskrcnn_vil_s_1x.py', 'coco'), ('upernet_vil_s_160k_ade20k.py', 'ade20k')]
)
def test_cli_writes_a_real_config_as_a_short_run_on_the_data(tmp_path, capsys, config, layout):
    """``--config --iters``: the config's own pipeline and model, the toy data, a short run that ends in a
    checkpoint and keeps every detection of an untrained model."""
    out = tmp_path / 'toy'
    toy.main(
        [
            layout,
            str(out),
            '--num-train',
            '2',
            '--num-val',
            '1',
            '--config',
            str(ROOT / 'configs' / config),
            '--iters',
            '3',
        ]
    )
    written = out / config.replace('.py', '_toy.py')
    assert f'on it: {written}' in capsys.readouterr().out
    original, cfg = Config.fromfile(ROOT / 'configs' / config), Config.fromfile(written)
    assert cfg.model.backbone.init_cfg is None and cfg.model.backbone.arch == original.model.backbone.arch
    assert cfg.train_dataloader.dataset.pipeline == original.train_dataloader.dataset.pipeline
    assert cfg.train_dataloader.dataset.data_root == f'{out}/'
    assert cfg.train_cfg == dict(type='IterBasedTrainLoop', max_iters=3, val_interval=3)
    assert (cfg.default_hooks.checkpoint.interval, cfg.default_hooks.checkpoint.by_epoch) == (3, False)
    assert cfg.param_scheduler == []
    if layout == 'coco':
        assert cfg.model.test_cfg.rcnn.score_thr == 0.0 and original.model.test_cfg.rcnn.score_thr > 0
        assert cfg.val_evaluator.ann_file == f'{out}/annotations/instances_val.json'
        assert cfg.model.roi_head.bbox_head.num_classes == len(toy.COCO_CLASSES)
    else:
        assert cfg.model.decode_head.num_classes == len(toy.ADE_CLASSES)
