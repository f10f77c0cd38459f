"""The demo, `tools/run_demo.py`, exactly what `bash tools/demo.sh` runs.

``test_demo_learns`` runs it as ``bash tools/demo.sh --max-iters 40`` would: it trains Mask R-CNN
ViL-T from scratch on the generated toy COCO data through tools/train.py, evaluates the trained and
the untrained model through tools/test.py, and checks that training clearly helped, that the timed
training did not validate, that each model was evaluated once, and that the picture was drawn. 40
iterations, not the default 150, keep it the suite's longest test by little and learn enough, three
times the margin the test asks for: ``python tools/run_demo.py --max-iters 40`` gave bbox mAP 0.321
(AP50 0.767) on the 2-core machine on 2026-11-28, 0.001 untrained, in 5 min (60 iterations: 0.465;
150: 0.754, docs/training.md). The schedule the option gives is checked below. The other tests check
the options and the picture quickly.
"""

import argparse
import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from paths import ROOT

TEST_ITERS = 40  # training iterations of test_demo_learns (the demo's default: 150)


@pytest.fixture(scope='module')
def demo():
    spec = importlib.util.spec_from_file_location('_visattn_run_demo', ROOT / 'tools' / 'run_demo.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_learns(tmp_path):
    work_dir = tmp_path / 'demo'
    proc = subprocess.run(
        [sys.executable, 'tools/run_demo.py', '--max-iters', str(TEST_ITERS), '--work-dir', str(work_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,  # about 5 min on an idle 2-core machine; 11 while it is shared
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((work_dir / 'summary.json').read_text())
    trained, untrained = summary['trained'], summary['untrained']
    assert untrained['bbox_mAP'] < 0.05, summary
    assert trained['bbox_mAP'] > untrained['bbox_mAP'] + 0.10, summary
    assert 'segm_mAP' in trained
    assert summary['max_iters'] == TEST_ITERS and summary['train_minutes'] > 0
    # The timed training does not validate; the trained and the untrained model are
    # evaluated once each.
    assert 'coco/bbox_mAP' not in (work_dir / 'train.log').read_text()
    assert proc.stdout.count('tools/test.py') == 2
    # The console: a line per stage and the summary; every tool's output is in the logs it names.
    assert len(proc.stdout.splitlines()) <= 60, proc.stdout
    for log in ('train.log', 'test_untrained.log', 'test.log'):
        assert str(work_dir / log) in proc.stdout
    assert f'Iter(train) [{TEST_ITERS}/{TEST_ITERS}]' in (work_dir / 'train.log').read_text()
    from PIL import Image

    with Image.open(work_dir / 'demo.png') as picture:
        assert picture.format == 'PNG' and picture.width >= 1500 and picture.height >= 800


def test_max_iters_option_rescales_the_schedule(demo):
    """--max-iters (advertised by tools/demo.sh) reaches tools/train.py as config overrides
    that tools/train.py's parser reads and that keep the schedule consistent."""
    from mmengine.config import Config, DictAction

    args = demo.parse_args(['--max-iters', '20', '--work-dir', 'x'])
    cfg = Config.fromfile(demo.CONFIG)
    options = demo.schedule_options(args.max_iters, cfg.param_scheduler[0]['end'], cfg.default_hooks.logger.interval)
    parser = argparse.ArgumentParser()
    parser.add_argument('--cfg-options', nargs='+', action=DictAction)
    cfg.merge_from_dict(parser.parse_args(['--cfg-options', *demo.NO_VALIDATION, *options]).cfg_options)
    assert cfg.train_cfg.max_iters == 20
    warmup, steps = cfg.param_scheduler
    assert warmup['end'] == 20 and steps['end'] == 20 and steps['milestones'] == [15, 18]
    assert cfg.default_hooks.checkpoint.interval == 20 and cfg.default_hooks.logger.interval == 5
    assert cfg.val_cfg is None and cfg.val_dataloader is None and cfg.val_evaluator is None
    assert cfg.test_dataloader is not None  # tools/test.py still evaluates
    assert demo.schedule_options(2, 50, 5)[-1] == 'default_hooks.logger.interval=2'
    with pytest.raises(SystemExit):
        demo.parse_args(['--max-iters', '0'])


def _fake_predictions(coco, images):
    """Per image: every ground-truth object found (score 0.9) plus a low-scoring duplicate
    of it with another label (score 0.2), as an undertrained detector gives."""
    from pycocotools import mask as mask_utils

    results = []
    for image in images:
        boxes, scores, labels, masks = [], [], [], []
        for ann in coco.loadAnns(coco.getAnnIds(imgIds=[image['id']])):
            x, y, w, h = ann['bbox']
            rle = mask_utils.merge(mask_utils.frPyObjects(ann['segmentation'], image['height'], image['width']))
            label = sorted(coco.getCatIds()).index(ann['category_id'])
            for score, lab in ((0.9, label), (0.2, (label + 1) % 3)):
                boxes.append([x, y, x + w, y + h])
                scores.append(score)
                labels.append(lab)
                masks.append(rle)
        results.append(
            dict(
                img_id=image['id'],
                img_path=image['path'],
                pred_instances=dict(
                    bboxes=torch.tensor(boxes), scores=torch.tensor(scores), labels=torch.tensor(labels), masks=masks
                ),
            )
        )
    return results


def test_picture_labels_thresholds_and_shows_the_loss(demo, tmp_path):
    from PIL import Image
    from pycocotools.coco import COCO

    data = demo.make_coco_instances(tmp_path / 'toy', num_train=1, num_val=4)
    ann_file = data / 'annotations' / 'instances_val.json'
    coco = COCO(str(ann_file))
    images = coco.loadImgs(sorted(coco.getImgIds()))
    for image in images:
        image['path'] = str(data / 'val' / image['file_name'])
    predictions = _fake_predictions(coco, images)

    # The threshold drops the low-scoring duplicates; so does the overlap rule.
    objects = len(coco.getAnnIds(imgIds=[images[0]['id']]))
    for score_thr in (0.5, 0.1):
        shown = demo.visible_predictions(predictions[0]['pred_instances'], score_thr)
        assert len(shown) == objects and all(p['score'] == pytest.approx(0.9) for p in shown)
    # Boxes stacked on one object (covering 100% of the smaller box, any class; one nested
    # inside the best): only the best is drawn; one covering 40% of the smaller box stays; one
    # scoring under 0.5 goes. Best first.
    stacked = dict(
        bboxes=torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 6], [2, 2, 4, 4], [6, 0, 16, 6], [20, 20, 30, 30]]),
        scores=torch.tensor([0.8, 0.9, 0.6, 0.7, 0.3]),
        labels=torch.tensor([0, 0, 1, 2, 0]),
        masks=['a', 'b', 'c', 'd', 'e'],
    )
    assert [p['mask'] for p in demo.visible_predictions(stacked, 0.5)] == ['b', 'd']

    work_dir = tmp_path / 'work'
    (work_dir / '20260101_000000' / 'vis_data').mkdir(parents=True)
    (work_dir / '20260101_000000' / 'vis_data' / 'scalars.json').write_text(
        ''.join(json.dumps(dict(loss=3.0 / (i + 1), lr=1e-4, iter=i, step=i)) + '\n' for i in range(5, 30, 5))
    )
    out = tmp_path / 'demo.png'
    demo.draw_demo_picture(
        predictions,
        ann_file,
        work_dir,
        out,
        ('circle', 'square', 'triangle'),
        [(220, 20, 60), (0, 128, 255), (0, 200, 0)],
        score_thr=0.5,
        num_images=4,
        title='test',
    )
    with Image.open(out) as picture:
        assert picture.format == 'PNG'
        # Two rows of two (ground truth, prediction) pairs at 2.5x, and the curve.
        assert picture.width >= 4 * 160 * 2.5 and picture.height >= 2 * 128 * 2.5
