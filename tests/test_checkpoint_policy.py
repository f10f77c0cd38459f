"""One checkpoint policy for whole models: load_from, tools/test.py CHECKPOINT, --resume, and init_cfg lists.

In-process: the policy on a tiny RetinaNet-ViL (classification checkpoints converted into
the backbone for load_from, refused for testing and resuming; other models refused with the
load report). Through the tools (subprocesses on the tiny Mask R-CNN of test_tools_cli):
the refusal's exit code and message, and one line for an empty or truncated file.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mmengine.config import Config

from helpers import VIL_TINY_ARCH, assert_unchanged, snapshot
from test_tools_cli import DET_CONFIG, TOOLS, toy
from visattn_mm.checkpoint import CheckpointError, load_model_checkpoint
from visattn_mm.models import Classifier, ViL

ROOT = Path(__file__).resolve().parents[1]
VIL_CLS_ATTN = ('sliding_chunk', 'sliding_chunk', 'full', 'full')   # the official classification layout


def resnet50_like_checkpoint():
    """A few tensors of a torchvision ResNet-50 ImageNet checkpoint (bare state_dict, real shapes)."""
    return {'conv1.weight': torch.randn(64, 3, 7, 7), 'bn1.weight': torch.ones(64), 'bn1.bias': torch.zeros(64),
            'layer1.0.conv1.weight': torch.randn(64, 64, 1, 1), 'fc.weight': torch.randn(1000, 2048),
            'fc.bias': torch.zeros(1000)}


@pytest.fixture(scope='module')
def build_detector():
    """Builds a RetinaNet with a tiny ViL from configs/retinanet_vil_t_1x.py, randomly initialised."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.registry import init_default_scope
    register_all_modules(init_default_scope=False)
    init_default_scope('mmdet')
    cfg = Config.fromfile(ROOT / 'configs' / 'retinanet_vil_t_1x.py')
    cfg.model.backbone.update(arch=VIL_TINY_ARCH, init_cfg=None)
    cfg.model.neck.in_channels = [32, 32, 32]

    def build(seed):
        torch.manual_seed(seed)
        return MODELS.build(cfg.model)
    return build


@pytest.fixture(scope='module')
def classifier():
    torch.manual_seed(3)
    return Classifier(arch=VIL_TINY_ARCH, attn_types=VIL_CLS_ATTN, num_classes=10)


def test_load_from_classification_checkpoint_converts_it_into_the_backbone(build_detector, classifier):
    detector = build_detector(0)
    neck_before = snapshot(detector.neck)
    report = load_model_checkpoint(detector, {'state_dict': classifier.state_dict()}, 'cls.pth', 'load_from')
    assert report.container == 'state_dict+backbone.' and report.missing == [] and report.unexpected == []
    ours, theirs = detector.backbone.state_dict(), classifier.backbone.state_dict()
    for stage in (2, 3):   # full attention in the checkpoint, sliding-chunk in the detector
        prefix = f'stages.{stage}.blocks.0.attn.'
        qkv, dim = theirs[prefix + 'qkv.weight'], ours[prefix + 'query.weight'].shape[0]
        assert torch.equal(ours[prefix + 'query.weight'], qkv[:dim])
        assert torch.equal(ours[prefix + 'kv.weight'], qkv[dim:])
        assert prefix + 'query.weight' in report.converted
    assert torch.equal(ours['stages.1.blocks.0.attn.kv.weight'], theirs['stages.1.blocks.0.attn.kv.weight'])
    assert_unchanged(detector.neck, neck_before)


@pytest.mark.parametrize('purpose,action', [('test', 'evaluate'), ('resume', 'resume from')])
def test_classification_checkpoint_cannot_be_evaluated_or_resumed(build_detector, classifier, purpose, action):
    detector = build_detector(0)
    before = snapshot(detector)
    with pytest.raises(CheckpointError, match=f'refusing to {action} cls.pth: it holds backbone-only') as err:
        load_model_checkpoint(detector, {'state_dict': classifier.state_dict()}, 'cls.pth', purpose)
    assert 'none for neck, bbox_head' in str(err.value) and 'tools/train.py' in str(err.value)
    assert_unchanged(detector, before)


def test_checkpoint_of_another_model_is_refused_with_the_report(build_detector):
    """A whole-detector checkpoint of a ResNet-50 RetinaNet: the head fits, the rest does not."""
    detector, other = build_detector(0), build_detector(1)
    state_dict = {f'backbone.{k}': v for k, v in resnet50_like_checkpoint().items()}
    state_dict.update({k: v for k, v in other.state_dict().items() if k.startswith('bbox_head.')})
    before = snapshot(detector)
    with pytest.raises(CheckpointError, match=r'refusing to load: only \d+ of \d+ parameter tensors of '
                                              'RetinaNet match r50.pth') as err:
        load_model_checkpoint(detector, {'state_dict': state_dict, 'meta': {}}, 'r50.pth', 'load_from')
    message = str(err.value)
    for needed in ("layout 'whole model'", 'missing:', 'unexpected: 6 (backbone.conv1.weight',
                   'another backbone', 'load_from_allow_partial=True'):
        assert needed in message, needed
    assert_unchanged(detector, before)
    report = load_model_checkpoint(detector, {'state_dict': state_dict}, 'r50.pth', 'load_from', allow_partial=True)
    assert torch.equal(detector.bbox_head.retina_cls.weight, other.bbox_head.retina_cls.weight)
    assert 0 < report.loaded_fraction < 0.9


def test_checkpoint_of_this_model_loads_whole(build_detector):
    """Control for the refusals above: a checkpoint of the same model loads every tensor."""
    detector, other = build_detector(0), build_detector(1)
    checkpoint = {'state_dict': other.state_dict(), 'meta': {'iter': 4}}
    report = load_model_checkpoint(detector, checkpoint, 'iter_4.pth', 'resume')
    assert report.loaded_fraction == 1 and report.missing == [] and report.unexpected == []
    for key, value in detector.state_dict().items():
        assert torch.equal(value, other.state_dict()[key]), key
    with pytest.raises(CheckpointError, match="no training progress \\('meta'\\)"):
        load_model_checkpoint(detector, {'state_dict': other.state_dict()}, 'weights.pth', 'resume')


def test_init_cfg_list_loads_pretrained_after_the_others(tmp_path):
    torch.manual_seed(1)
    source = ViL(arch=VIL_TINY_ARCH)
    path = tmp_path / 'vil.pth'
    torch.save({'state_dict': source.state_dict()}, path)
    model = ViL(arch=VIL_TINY_ARCH, init_cfg=[
        dict(type='Constant', layer='Linear', val=0.5, bias=0.5),
        dict(type='Pretrained', checkpoint=str(path))])
    model.init_weights()
    for key, value in model.state_dict().items():
        assert torch.equal(value, source.state_dict()[key]), key

    model = ViL(arch=VIL_TINY_ARCH, init_cfg=[dict(type='Constant', layer='Linear', val=0.5, bias=0.5)])
    model.init_weights()
    assert (model.stages[0].blocks[0].mlp.fc1.weight == 0.5).all()
    with pytest.raises(TypeError, match="init_cfg must be a dict or a list of dicts, each with a type"):
        ViL(arch=VIL_TINY_ARCH, init_cfg=['checkpoints/vil.pth']).init_weights()


# --------------------------------------------------------------------------
# Through the tools: exit status and message
# --------------------------------------------------------------------------
@pytest.fixture(scope='module')
def workspace(tmp_path_factory):
    """The tiny Mask R-CNN config of test_tools_cli with its toy data, and bad checkpoints."""
    root = tmp_path_factory.mktemp('policy')
    data = toy.make_coco_instances(root / 'toy_coco', num_train=2, num_val=2)
    (root / 'tiny_mask_rcnn.py').write_text(DET_CONFIG.format(data_root=data, classes=toy.COCO_CLASSES))
    torch.save(resnet50_like_checkpoint(), root / 'resnet50.pth')
    (root / 'empty.pth').write_bytes(b'')
    whole = root / 'whole.pth'
    torch.save({'state_dict': {'a': torch.zeros(1000)}, 'meta': {}}, whole)
    (root / 'truncated.pth').write_bytes(whole.read_bytes()[:whole.stat().st_size // 2])
    return root


def _run_tool(workspace, name, work_dir, *args):
    return subprocess.run([sys.executable, str(TOOLS / name), 'tiny_mask_rcnn.py', *args, '--work-dir', work_dir],
                          cwd=workspace, capture_output=True, text=True, timeout=300)


def test_test_tool_refuses_a_classification_checkpoint(workspace):
    proc = _run_tool(workspace, 'test.py', 'work_test', 'resnet50.pth')
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr
    assert 'error: refusing to evaluate resnet50.pth: it holds backbone-only' in proc.stderr
    assert 'none for neck, rpn_head, roi_head' in proc.stderr and 'tools/train.py' in proc.stderr
    assert not list((workspace / 'work_test').glob('*/*.json'))    # no metrics were written


def test_train_tool_refuses_load_from_of_another_backbone(workspace):
    proc = _run_tool(workspace, 'train.py', 'work_load_from', '--cfg-options', 'load_from=resnet50.pth',
                     'train_cfg.max_iters=1',
                     'train_cfg.val_interval=100')
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr
    assert 'error: refusing to load: only 0 of' in proc.stderr and 'parameter tensors of ResNet match' in proc.stderr
    assert "load_from='resnet50.pth' holds backbone-only" in proc.stderr
    assert 'conv1.weight ckpt (64, 3, 7, 7) vs model (16, 3, 7, 7)' in proc.stderr   # the load report
    assert 'Iter(train)' not in proc.stdout + proc.stderr


@pytest.mark.parametrize('tool,args,problem', [
    ('test.py', ['empty.pth'], 'the file is empty'),
    ('train.py', ['--resume', 'truncated.pth'], 'the file may be truncated'),
])
def test_unreadable_checkpoint_is_one_line_naming_the_file(workspace, tool, args, problem):
    proc = _run_tool(workspace, tool, f'work_{tool}', *args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f'error: {args[-1]}: ') and problem in last
