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

from helpers import VIL_TINY_ARCH, assert_unchanged, numbered_layout_names, snapshot, use_tiny_backbone
from paths import ROOT
from tool_runs import DET_CONFIG, TOOLS
from visattn_mm import toy_data as toy
from visattn_mm.checkpoint import CheckpointError, load_model_checkpoint
from visattn_mm.checkpoint.policy import REFUSED_ACTION
from visattn_mm.models import Classifier, ViL

VIL_CLS_ATTN = ('sliding_chunk', 'sliding_chunk', 'full', 'full')  # the official classification layout


def resnet50_like_checkpoint():
    """A few tensors of a torchvision ResNet-50 ImageNet checkpoint (bare state_dict, real shapes)."""
    return {
        'conv1.weight': torch.randn(64, 3, 7, 7),
        'bn1.weight': torch.ones(64),
        'bn1.bias': torch.zeros(64),
        'layer1.0.conv1.weight': torch.randn(64, 64, 1, 1),
        'fc.weight': torch.randn(1000, 2048),
        'fc.bias': torch.zeros(1000),
    }


def build_config_model(config, seed, **options):
    """The model of ``configs/<config>`` with a tiny backbone (its tiny arch), randomly initialised.

    ``options`` are config overrides, e.g. ``{'model.bbox_head.num_classes': 80}``.
    """
    import importlib

    from mmengine.registry import init_default_scope

    cfg = Config.fromfile(ROOT / 'configs' / config)
    importlib.import_module(f'{cfg.default_scope}.utils').register_all_modules(init_default_scope=False)
    init_default_scope(cfg.default_scope)
    use_tiny_backbone(cfg)
    cfg.merge_from_dict(options)
    torch.manual_seed(seed)
    return importlib.import_module(f'{cfg.default_scope}.registry').MODELS.build(cfg.model)


@pytest.fixture(scope='module')
def build_detector():
    """Builds a RetinaNet with a tiny ViL from configs/retinanet_vil_t_1x.py, randomly initialised."""
    return lambda seed, **options: build_config_model('retinanet_vil_t_1x.py', seed, **options)


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
    for stage in (2, 3):  # full attention in the checkpoint, sliding-chunk in the detector
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
    with pytest.raises(CheckpointError, match=f'refusing to {action} cls.pth: ') as err:
        load_model_checkpoint(detector, {'state_dict': classifier.state_dict()}, 'cls.pth', purpose)
    message = str(err.value)
    assert 'It holds backbone-only weights (ImageNet classification weights of this ViL' in message
    assert 'none for neck, bbox_head' in message and 'load_from=cls.pth' in message  # the fix that works
    assert_unchanged(detector, before)


@pytest.mark.parametrize('purpose', ['test', 'resume'])
def test_backbone_only_checkpoint_of_another_backbone_is_not_sent_to_init_cfg(build_detector, purpose):
    """A ResNet-50 ImageNet file: init_cfg and load_from would refuse it too, so they are not the fix."""
    detector = build_detector(0)
    with pytest.raises(CheckpointError) as err:
        load_model_checkpoint(detector, resnet50_like_checkpoint(), 'r50.pth', purpose)
    message = str(err.value)
    assert 'It holds backbone-only weights of another backbone or size' in message
    assert '0 of ' in message and "parameter tensors match) of this config's ViL" not in message
    assert 'Neither init_cfg nor load_from can use it' in message and 'tools/convert_ckpt.py' in message
    assert 'load_from=r50.pth' not in message
    # Not called a whole model, and no partial evaluation offered where nothing fits.
    assert "layout 'not a whole model of this kind (top-level names conv1, bn1, layer1" in message
    assert 'allow-partial' not in message
    if purpose == 'test':
        assert 'No tensor of it fits this model, so a partial evaluation has nothing to load.' in message


@pytest.mark.parametrize('purpose', ['test', 'resume'])
def test_checkpoint_of_another_detector_is_refused_as_such(build_detector, purpose):
    """A Mask R-CNN ViL-T checkpoint for the RetinaNet ViL-T config: its backbone fits, the head is absent.

    Under the 90% rule it loaded and evaluated a random RetinaNet head (mAP 0).
    """
    detector = build_detector(0)
    mask_rcnn = build_config_model('maskrcnn_vil_t_1x.py', 1)
    before = snapshot(detector)
    with pytest.raises(CheckpointError, match=f'refusing to {REFUSED_ACTION[purpose]} mask_rcnn.pth') as err:
        load_model_checkpoint(detector, {'state_dict': mask_rcnn.state_dict(), 'meta': {}}, 'mask_rcnn.pth', purpose)
    message = str(err.value)
    assert (
        "It holds another detector or segmentor: its parts are neck, rpn_head, roi_head; this config's are "
        "neck, bbox_head; its backbone fits this config's ViL"
    ) in message
    assert 'not in it: ' in message and 'bbox_head (20: bbox_head.cls_convs.0.conv.weight' in message
    assert 'config it was trained with' in message
    assert_unchanged(detector, before)


def test_detector_checkpoint_given_to_a_segmentor_is_not_called_backbone_only():
    """A RetinaNet VVT-T checkpoint evaluated with the UperNet VVT-T config."""
    segmentor = build_config_model('upernet_vvt_t_160k_ade20k.py', 0)
    retinanet = build_config_model('retinanet_vvt_t_1x.py', 1)
    with pytest.raises(CheckpointError) as err:
        load_model_checkpoint(segmentor, {'state_dict': retinanet.state_dict()}, 'retinanet.pth', 'test')
    message = str(err.value)
    assert (
        "It holds another detector or segmentor: its parts are neck, bbox_head; this config's are "
        "decode_head, auxiliary_head; its backbone fits this config's VVT" in message
    )
    assert 'backbone-only' not in message


@pytest.mark.parametrize('trained,configured', [(80, 3), (3, 80)])
def test_checkpoint_of_another_class_count_names_both_counts(build_detector, trained, configured):
    """80-class weights in a 3-class config evaluated to mAP 0; 3 in 80 crashed in CocoMetric (IndexError)."""
    detector = build_detector(0, **{'model.bbox_head.num_classes': configured})
    other = build_detector(1, **{'model.bbox_head.num_classes': trained})
    before = snapshot(detector)
    with pytest.raises(CheckpointError) as err:
        load_model_checkpoint(detector, {'state_dict': other.state_dict()}, 'retinanet.pth', 'test')
    message = str(err.value)
    assert (
        f'bbox_head.retina_cls.weight: the checkpoint predicts {trained} classes, the config {configured} '
        f'(checkpoint ({9 * trained}, 256, 3, 3), model ({9 * configured}, 256, 3, 3))'
    ) in message
    assert f'--cfg-options model.bbox_head.num_classes={trained}' in message
    assert 'load_from_allow_partial=True' in message
    assert_unchanged(detector, before)


def test_partial_evaluation_on_purpose_loads_what_matches(build_detector):
    detector = build_detector(0, **{'model.bbox_head.num_classes': 3})
    other = build_detector(1, **{'model.bbox_head.num_classes': 80})
    random_head = detector.bbox_head.retina_cls.weight.detach().clone()
    with pytest.raises(CheckpointError, match='the checkpoint predicts 80 classes'):
        load_model_checkpoint(detector, {'state_dict': other.state_dict()}, 'retinanet.pth', 'test')
    report = load_model_checkpoint(
        detector, {'state_dict': other.state_dict()}, 'retinanet.pth', 'test', allow_partial=True
    )
    assert report.missing == ['bbox_head.retina_cls.weight', 'bbox_head.retina_cls.bias']
    assert torch.equal(detector.bbox_head.retina_cls.weight, random_head)
    assert torch.equal(detector.neck.fpn_convs[0].conv.weight, other.neck.fpn_convs[0].conv.weight)


def test_resume_from_published_weights_says_what_is_missing(build_detector):
    """What mmdet's publish_model.py leaves ('meta' and 'state_dict'): mmengine raised KeyError: 'message_hub'."""
    detector, other = build_detector(0), build_detector(1)
    published = {'meta': {'epoch': 12, 'iter': 1000}, 'state_dict': other.state_dict()}
    before = snapshot(detector)
    with pytest.raises(CheckpointError) as err:
        load_model_checkpoint(detector, published, 'published.pth', 'resume')
    message = str(err.value)
    assert "'message_hub', 'optimizer', 'param_schedulers' missing" in message
    assert 'publish_model.py' in message and '--cfg-options load_from=published.pth' in message
    assert_unchanged(detector, before)


def test_checkpoint_of_another_model_is_refused_with_the_report(build_detector):
    """A whole-detector checkpoint of a ResNet-50 RetinaNet: the head fits, the rest does not."""
    detector, other = build_detector(0), build_detector(1)
    state_dict = {f'backbone.{k}': v for k, v in resnet50_like_checkpoint().items()}
    state_dict.update({k: v for k, v in other.state_dict().items() if k.startswith('bbox_head.')})
    before = snapshot(detector)
    with pytest.raises(
        CheckpointError,
        match=r'refusing to load: only \d+ of \d+ parameter tensors of '
        'RetinaNet match r50.pth',
    ) as err:
        load_model_checkpoint(detector, {'state_dict': state_dict, 'meta': {}}, 'r50.pth', 'load_from')
    message = str(err.value)
    for needed in (
        "layout 'whole model'",
        'missing:',
        'unexpected: 6 (backbone.conv1.weight',
        'another backbone',
        'load_from_allow_partial=True',
    ):
        assert needed in message, needed
    assert_unchanged(detector, before)
    report = load_model_checkpoint(detector, {'state_dict': state_dict}, 'r50.pth', 'load_from', allow_partial=True)
    assert torch.equal(detector.bbox_head.retina_cls.weight, other.bbox_head.retina_cls.weight)
    assert 0 < report.loaded_fraction < 0.9


def test_checkpoint_of_this_model_loads_whole(build_detector):
    """Control for the refusals above: a checkpoint of the same model loads every tensor."""
    detector, other = build_detector(0), build_detector(1)
    checkpoint = {'state_dict': other.state_dict(), 'meta': {'epoch': 0, 'iter': 4}, 'message_hub': {}}
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
    model = ViL(
        arch=VIL_TINY_ARCH,
        init_cfg=[
            dict(type='Constant', layer='Linear', val=0.5, bias=0.5),
            dict(type='Pretrained', checkpoint=str(path)),
        ],
    )
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
    (root / 'truncated.pth').write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    eighty_classes = _tiny_mask_rcnn(
        root, {'model.roi_head.bbox_head.num_classes': 80, 'model.roi_head.mask_head.num_classes': 80}
    )
    torch.save({'state_dict': eighty_classes.state_dict(), 'meta': {'epoch': 0, 'iter': 4}}, root / 'classes80.pth')
    published = _tiny_mask_rcnn(root, {})
    torch.save({'state_dict': published.state_dict(), 'meta': {'epoch': 0, 'iter': 4}}, root / 'published.pth')
    # How the plugin's configs reach mmdet's own scripts: they import it and select its Runner.
    (root / 'plugin_mask_rcnn.py').write_text(
        "_base_ = ['tiny_mask_rcnn.py']\n"
        "custom_imports = dict(imports=['visattn_mm'], allow_failed_imports=False)\n"
        "runner_type = 'CheckpointPolicyRunner'\n"
    )
    return root


def _tiny_mask_rcnn(root, options):
    """The model of the workspace's tiny Mask R-CNN config with ``options`` applied, randomly initialised."""
    from mmdet.registry import MODELS
    from mmdet.utils import register_all_modules
    from mmengine.registry import init_default_scope

    register_all_modules(init_default_scope=False)
    init_default_scope('mmdet')
    cfg = Config.fromfile(root / 'tiny_mask_rcnn.py')
    cfg.merge_from_dict(options)
    return MODELS.build(cfg.model)


def _run_tool(workspace, name, work_dir, *args):
    return subprocess.run(
        [sys.executable, str(TOOLS / name), 'tiny_mask_rcnn.py', *args, '--work-dir', work_dir],
        cwd=workspace,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_test_tool_refuses_a_classification_checkpoint(workspace):
    proc = _run_tool(workspace, 'test.py', 'work_test', 'resnet50.pth')
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr
    assert 'error: refusing to evaluate resnet50.pth: ' in proc.stderr
    assert 'It holds backbone-only weights of another backbone or size' in proc.stderr
    assert 'none for neck, rpn_head, roi_head' in proc.stderr and 'tools/train.py' in proc.stderr
    assert not list((workspace / 'work_test').glob('*/*.json'))  # no metrics were written


def test_test_tool_refuses_another_class_count_and_evaluates_it_with_allow_partial(workspace):
    """80-class weights in the 3-class config: loaded 97% under the 90% rule and evaluated to mAP 0."""
    proc = _run_tool(workspace, 'test.py', 'work_classes', 'classes80.pth')
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr
    assert (
        'roi_head.bbox_head.fc_cls.weight: the checkpoint predicts 80 classes, the config 3 '
        '(checkpoint (81, 64), model (4, 64))'
    ) in proc.stderr
    assert 'add --allow-partial' in proc.stderr and 'load_from_allow_partial' not in proc.stderr
    assert not list((workspace / 'work_classes').glob('*/*.json'))

    proc = _run_tool(workspace, 'test.py', 'work_partial', 'classes80.pth', '--allow-partial')
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 'tensors of MaskRCNN not from it' in proc.stdout + proc.stderr
    assert list((workspace / 'work_partial').glob('*/*.json'))  # the metrics of the partial match


def test_mmdet_test_script_through_the_configs_runner_refuses_too(workspace):
    """mmdet's own tools/test.py builds the config's runner_type: the same refusal, naming --cfg-options."""
    import mmdet

    script = Path(mmdet.__file__).parent / '.mim' / 'tools' / 'test.py'
    proc = subprocess.run(
        [sys.executable, str(script), 'plugin_mask_rcnn.py', 'classes80.pth', '--work-dir', 'work_mmdet'],
        cwd=workspace,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'CheckpointError: refusing to evaluate classes80.pth' in proc.stderr
    assert 'the checkpoint predicts 80 classes, the config 3' in proc.stderr
    assert '(--cfg-options load_from_allow_partial=True)' in proc.stderr
    assert not list((workspace / 'work_mmdet').glob('*/*.json'))


def test_resume_from_published_weights_exits_with_the_fix(workspace):
    """mmdet's publish_model.py keeps 'meta' and 'state_dict': resuming ended in KeyError: 'message_hub'."""
    proc = _run_tool(workspace, 'train.py', 'work_published', '--resume', 'published.pth')
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith('error: refusing to resume from published.pth: it holds the weights of this model')
    assert "'message_hub', 'optimizer', 'param_schedulers' missing" in last
    assert 'tools/train.py CONFIG --cfg-options load_from=published.pth' in last
    assert 'Iter(train)' not in proc.stdout + proc.stderr


def test_train_tool_refuses_load_from_of_another_backbone(workspace):
    proc = _run_tool(
        workspace,
        'train.py',
        'work_load_from',
        '--cfg-options',
        'load_from=resnet50.pth',
        'train_cfg.max_iters=1',
        'train_cfg.val_interval=100',
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr
    assert 'error: refusing to load: only 0 of' in proc.stderr and 'parameter tensors of ResNet match' in proc.stderr
    assert "load_from='resnet50.pth' holds backbone-only" in proc.stderr
    assert 'conv1.weight ckpt (64, 3, 7, 7) vs model (16, 3, 7, 7)' in proc.stderr  # the load report
    assert 'Iter(train)' not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    'tool,args,problem',
    [
        ('test.py', ['empty.pth'], 'the file is empty'),
        ('train.py', ['--resume', 'truncated.pth'], 'the file may be truncated'),
    ],
)
def test_unreadable_checkpoint_is_one_line_naming_the_file(workspace, tool, args, problem):
    proc = _run_tool(workspace, tool, f'work_{tool}', *args)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert 'Traceback' not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f'error: {args[-1]}: ') and problem in last


def test_pale_detector_saved_with_the_numbered_layout_is_evaluated_but_not_resumed():
    """A whole-detector file from before the shared stage layout (``backbone.patch_embed{n}``,
    ``backbone.block{n}``, ``backbone.norm{n}``): evaluated with every tensor renamed; --resume
    refused, as its optimizer state follows the old parameter order."""
    detector, other = (build_config_model('retinanet_pale_t_1x.py', seed) for seed in (0, 1))
    old = {f'backbone.{k}': v for k, v in numbered_layout_names(other.backbone.state_dict(), False).items()}
    old.update({k: v for k, v in other.state_dict().items() if not k.startswith('backbone.')})
    checkpoint = {'state_dict': old, 'meta': {'epoch': 0, 'iter': 4}, 'message_hub': {}}
    before = snapshot(detector)
    with pytest.raises(
        CheckpointError, match='refusing to resume from old.pth: it was saved with an older layout'
    ) as err:
        load_model_checkpoint(detector, checkpoint, 'old.pth', 'resume')
    assert '--cfg-options load_from=old.pth' in str(err.value)
    assert_unchanged(detector, before)
    report = load_model_checkpoint(detector, checkpoint, 'old.pth', 'test')
    assert report.missing == [] and report.unexpected == []
    assert set(report.renamed.values()) == {k for k in old if k.startswith('backbone.')}
    for key, value in detector.state_dict().items():
        assert torch.equal(value, other.state_dict()[key]), key
