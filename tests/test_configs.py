"""The config matrix in configs/: completeness, schedule and optimiser facts, checkpoint paths,
paper parameter counts, and one training iteration of every model on tiny generated data.

Models are built once per (task, backbone variant): the 1x and 3x+MS configs of a detector
must have identical model dicts, which is asserted instead of building twice.
"""

import ast
import copy
import functools
import importlib
import importlib.util
import inspect
import re

import numpy as np
import pytest
import torch
from mmengine.config import Config
from mmengine.optim import AmpOptimWrapper, build_optim_wrapper
from mmengine.registry import init_default_scope
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

import visattn_mm  # noqa: F401  (registration)
from paths import ROOT
from visattn_mm.timm_models import VARIANTS

CONFIG_DIR = ROOT / 'configs'
DEMO = 'demo/maskrcnn_vil_t_toy.py'
ALL_CONFIGS = sorted(str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.rglob('*.py') if '_base_' not in p.parts)
NAME = re.compile(
    r'(?P<task>maskrcnn|retinanet|upernet)_(?P<family>vil_ls|vil|pale|vvt)_(?P<size>[tsmbl])_'
    r'(?P<schedule>1x|3x_ms|160k_ade20k)\.py'
)

# What the issue asks for: every variant of every backbone, five configs each.
SIZES = dict(vil='tsmb', vil_ls='tsmb', pale='tsb', vvt='tsml')
SCHEDULES = dict(maskrcnn=('1x', '3x_ms'), retinanet=('1x', '3x_ms'), upernet=('160k_ade20k',))
SIZE_NAMES = dict(t='tiny', s='small', m='medium', b='base', l='large')
BACKBONE_TYPES = dict(vil='ViL', vil_ls='ViLLS', pale='PaleTransformer', vvt='VVT')
MATRIX = [name for name in ALL_CONFIGS if NAME.fullmatch(name)]
DETECTION = [name for name in MATRIX if not name.startswith('upernet')]
SEGMENTATION = [name for name in MATRIX if name.startswith('upernet')]

# Paper recipes (ViL paper, Table 10; Pale paper, appendix "Detailed Experimental Settings"); ViL-LS takes ViL's;
# VVT's are our choices.
VIL_DROP_PATH = dict(t=0.1, s=0.2, m=0.3, b=0.3)
DROP_PATH = dict(
    vil=VIL_DROP_PATH, vil_ls=VIL_DROP_PATH, vvt=dict(t=0.1, s=0.2, m=0.3, l=0.3), pale=dict(t=0.2, s=0.3, b=0.5)
)
PALE_SEG_DROP_PATH = dict(t=0.3, s=0.3, b=0.5)
MULTI_SCALES = [(1333, short) for short in (640, 672, 704, 736, 768, 800)]
NO_DECAY_NAMES = ('relative_position', 'cls_token', 'pos_embed')
NORM_TYPES = (nn.LayerNorm, nn.GroupNorm, _BatchNorm)
IMAGE_SIZE = 64


@functools.lru_cache(maxsize=None)
def load(name):
    """The resolved config; callers copy before changing anything."""
    return Config.fromfile(CONFIG_DIR / name)


def parts(name):
    return NAME.fullmatch(name).groupdict()


def pipeline_steps(pipeline, type_name):
    return [step for step in pipeline if step['type'] == type_name]


def test_matrix_is_complete():
    expected = sorted(
        f'{task}_{family}_{size}_{schedule}.py'
        for family, sizes in SIZES.items()
        for size in sizes
        for task, schedules in SCHEDULES.items()
        for schedule in schedules
    )
    assert MATRIX == expected
    assert set(ALL_CONFIGS) - set(MATRIX) == {DEMO}


@pytest.mark.parametrize('name', ALL_CONFIGS)
def test_config_imports_plugin_and_points_at_checkpoint(name):
    """custom_imports, the checkpoint-policy Runner and RNG-state saving everywhere; init_cfg at
    checkpoints/<timm name>.pth (the demo trains from scratch)."""
    cfg = load(name)
    assert 'visattn_mm' in cfg.custom_imports.imports
    assert cfg.runner_type == 'CheckpointPolicyRunner'  # also under mmdet's/mmseg's own tools and mim
    # Exact resume: the RNG states travel in checkpoints (RandomShiftHook includes RngStateHook).
    assert {h['type'] for h in cfg.custom_hooks} & {'RngStateHook', 'RandomShiftHook'}
    backbone = cfg.model.backbone
    if name == DEMO:
        assert backbone.init_cfg is None
        return
    family, size = parts(name)['family'], parts(name)['size']
    timm_name = f'{family}_{SIZE_NAMES[size]}'
    assert timm_name in VARIANTS
    assert backbone.type == BACKBONE_TYPES[family] and backbone.arch == SIZE_NAMES[size]
    assert backbone.init_cfg == dict(type='Pretrained', checkpoint=f'checkpoints/{timm_name}.pth')


@pytest.fixture(scope='module')
def apply_amp():
    """tools/train.py's --amp switch, with the accelerator check answered 'yes' (CPU machine)."""
    spec = importlib.util.spec_from_file_location('_visattn_train_for_configs', ROOT / 'tools' / 'train.py')
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train.common, 'has_accelerator', lambda: True)
        yield train.apply_amp


@pytest.mark.parametrize('name', ALL_CONFIGS)
def test_amp_switch_applies(name, apply_amp):
    """--amp turns the wrapper into an AmpOptimWrapper whose arguments all exist."""
    cfg = copy.deepcopy(load(name))
    apply_amp(cfg)
    wrapper = cfg.optim_wrapper
    assert wrapper.type == 'AmpOptimWrapper' and wrapper.loss_scale == 'dynamic'
    accepted = set(inspect.signature(AmpOptimWrapper).parameters) | set(
        inspect.signature(AmpOptimWrapper.__mro__[1]).parameters
    )
    assert set(wrapper) - {'type', '_scope_', 'paramwise_cfg', 'constructor'} <= accepted


def test_optimizer_groups_are_plain_dicts_that_compile_traces():
    """mmengine's compile=True: with a paramwise_cfg (every config has one) mmengine's default constructor
    leaves the optimizer ConfigDict parameter groups, and dynamo fails in the first optimizer step; every
    config builds its optimizer through ours, whose plain-dict groups a compiled step traces."""
    assert {load(name).optim_wrapper.get('constructor') for name in ALL_CONFIGS} == {
        'PlainGroupsOptimWrapperConstructor'
    }
    cfg = load(DETECTION[0]).optim_wrapper
    default = copy.deepcopy(cfg)
    default.pop('constructor')
    steps = {}
    for label, wrapper_cfg in (('ours', cfg), ('default', default)):
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        wrapper = build_optim_wrapper(model, copy.deepcopy(wrapper_cfg))
        model(torch.randn(2, 4)).sum().backward()
        try:
            torch.compile(wrapper.optimizer.step, backend='eager')()
            steps[label] = {type(group) for group in wrapper.optimizer.param_groups}
        except torch._dynamo.exc.InternalTorchDynamoError as error:
            steps[label] = str(error).splitlines()[0]
        torch._dynamo.reset()
    assert steps['ours'] == {dict}
    assert "'UserDefinedDictVariable' object has no attribute 'items'" in steps['default']  # the cause, still upstream


def test_layer_decay_constructor_scales_backbone_learning_rates_by_depth():
    """The documented layer-decay recipe (docs/training.md) on a config's model: the backbone's layer d
    of n gets lr * rate ** (n - 1 - d), the neck and heads the full lr; the no-decay rules stay; a
    rate that cannot work and a backbone without layer depths are refused."""
    cfg = load('retinanet_vil_t_1x.py')
    model = build_model(cfg)
    wrapper_cfg = copy.deepcopy(cfg.optim_wrapper)
    wrapper_cfg.constructor = 'LayerDecayOptimWrapperConstructor'
    wrapper_cfg.paramwise_cfg.layer_decay_rate = 0.75
    wrapper = build_optim_wrapper(model, wrapper_cfg)
    base_lr, names = cfg.optim_wrapper.optimizer.lr, {id(p): n for n, p in model.named_parameters()}
    num_layers = sum(len(stage.blocks) for stage in model.backbone.stages) + 2
    lrs = {}
    for group in wrapper.optimizer.param_groups:
        (param,) = group['params']
        lrs[names[id(param)]] = group['lr']
        assert type(group) is dict
    assert lrs['backbone.stages.0.patch_embed.proj.weight'] == pytest.approx(base_lr * 0.75 ** (num_layers - 1))
    assert lrs['backbone.stages.3.blocks.0.mlp.fc1.weight'] == pytest.approx(base_lr * 0.75)
    assert lrs['bbox_head.retina_cls.weight'] == lrs['neck.fpn_convs.0.conv.weight'] == base_lr
    assert weight_decay_by_name(model, wrapper_cfg) == weight_decay_by_name(model, cfg.optim_wrapper)
    for rate in (0, 1.5, None, True):
        wrapper_cfg.paramwise_cfg.layer_decay_rate = rate
        with pytest.raises(ValueError, match=f'layer_decay_rate={rate!r} must be a number in'):
            build_optim_wrapper(model, copy.deepcopy(wrapper_cfg))
    wrapper_cfg.paramwise_cfg.layer_decay_rate = 0.75
    with pytest.raises(ValueError, match=r"backbone \(Linear\) has no get_layer_depth"):
        build_optim_wrapper(nn.ModuleDict(dict(backbone=nn.Linear(2, 2))), copy.deepcopy(wrapper_cfg))


@pytest.mark.parametrize('name', DETECTION)
def test_detection_schedule_and_optimiser(name):
    cfg, p = load(name), parts(name)
    three_x = p['schedule'] == '3x_ms'
    assert cfg.train_cfg.max_epochs == (36 if three_x else 12)
    warmup, steps = cfg.param_scheduler
    assert (warmup.type, warmup.by_epoch, warmup.end) == ('LinearLR', False, 1000)
    assert (steps.type, steps.end, steps.milestones) == (
        'MultiStepLR',
        cfg.train_cfg.max_epochs,
        [27, 33] if three_x else [8, 11],
    )

    train_pipeline = cfg.train_dataloader.dataset.pipeline
    assert not [step for step in train_pipeline if 'Crop' in step['type']]
    if three_x:
        (resize,) = pipeline_steps(train_pipeline, 'RandomChoiceResize')
        assert [tuple(scale) for scale in resize.scales] == MULTI_SCALES and resize.keep_ratio
        assert not pipeline_steps(train_pipeline, 'Resize')
    else:
        (resize,) = pipeline_steps(train_pipeline, 'Resize')
        assert tuple(resize.scale) == (1333, 800) and resize.keep_ratio
    for loader in (cfg.val_dataloader, cfg.test_dataloader):
        (resize,) = pipeline_steps(loader.dataset.pipeline, 'Resize')
        assert tuple(resize.scale) == (1333, 800) and resize.keep_ratio

    (load_annotations,) = pipeline_steps(train_pipeline, 'LoadAnnotations')
    if p['task'] == 'maskrcnn':
        assert load_annotations.with_mask
        assert cfg.val_evaluator.metric == cfg.test_evaluator.metric == ['bbox', 'segm']
    else:
        assert cfg.model.backbone.out_indices == (1, 2, 3)
        neck = cfg.model.neck
        assert (neck.start_level, neck.add_extra_convs, neck.num_outs, len(neck.in_channels)) == (0, 'on_input', 5, 3)

    optimizer = cfg.optim_wrapper.optimizer
    family, size = p['family'], p['size']
    assert optimizer.type == 'AdamW'
    assert optimizer.lr == (8e-5 if family.startswith('vil') and size == 'b' else 1e-4)
    assert optimizer.weight_decay == (dict(t=0.001, s=0.001, b=0.05)[size] if family == 'pale' else 0.05)
    clip = cfg.optim_wrapper.get('clip_grad')
    expected_clip = (
        dict(
            vil=dict(maskrcnn=0.5, retinanet=1.0),
            vil_ls=dict(maskrcnn=0.5, retinanet=1.0),
            vvt=dict(maskrcnn=1.0, retinanet=1.0),
        )
        .get(family, {})
        .get(p['task'])
    )
    assert (clip.max_norm if clip else None) == expected_clip
    assert cfg.model.backbone.drop_path_rate == DROP_PATH[family][size]


@pytest.mark.parametrize('name', SEGMENTATION)
def test_segmentation_schedule_and_optimiser(name):
    cfg, p = load(name), parts(name)
    assert cfg.train_cfg.max_iters == 160000
    (crop,) = pipeline_steps(cfg.train_dataloader.dataset.pipeline, 'RandomCrop')
    assert tuple(crop.crop_size) == (512, 512)
    warmup, poly = cfg.param_scheduler
    assert (warmup.type, warmup.by_epoch, warmup.begin, warmup.end) == ('LinearLR', False, 0, 1500)
    assert (poly.type, poly.by_epoch, poly.begin, poly.end, poly.power) == ('PolyLR', False, 1500, 160000, 1.0)
    optimizer = cfg.optim_wrapper.optimizer
    assert (optimizer.type, optimizer.lr, optimizer.weight_decay) == ('AdamW', 6e-5, 0.01)
    assert 'clip_grad' not in cfg.optim_wrapper

    model = cfg.model
    dims = model.decode_head.in_channels
    assert len(dims) == 4 and model.auxiliary_head.in_index == 2 and model.auxiliary_head.in_channels == dims[2]
    assert model.auxiliary_head.loss_decode.loss_weight == 0.4
    assert model.decode_head.norm_cfg.type == model.auxiliary_head.norm_cfg.type == 'BN'
    assert tuple(model.data_preprocessor.size) == (512, 512)
    assert model.data_preprocessor.test_cfg == dict(size_divisor=32)
    drop_path = PALE_SEG_DROP_PATH if p['family'] == 'pale' else DROP_PATH[p['family']]
    assert model.backbone.drop_path_rate == drop_path[p['size']]


def optimiser_literals(source):
    """``(key path, value)`` of every literal a config's text writes under its top-level ``optim_wrapper``.

    ``optim_wrapper = dict(clip_grad=dict(max_norm=0.5))`` gives
    ``(('optim_wrapper', 'clip_grad', 'max_norm'), 0.5)``; values taken from a base
    (``_base_.det_optim_wrapper.maskrcnn.s``) are not literals of the file.
    """

    def walk(node, keys):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == 'dict':
            pairs = [(keyword.arg, keyword.value) for keyword in node.keywords if keyword.arg]
        elif isinstance(node, ast.Dict):
            pairs = [(key.value, value) for key, value in zip(node.keys, node.values) if isinstance(key, ast.Constant)]
        else:
            return [(keys, node.value)] if isinstance(node, ast.Constant) else []
        return [found for key, value in pairs for found in walk(value, (*keys, key))]

    return [
        found
        for statement in ast.parse(source).body
        if isinstance(statement, ast.Assign)
        and any(isinstance(target, ast.Name) and target.id == 'optim_wrapper' for target in statement.targets)
        for found in walk(statement.value, ('optim_wrapper',))
    ]


def test_optimiser_literals_finds_what_a_config_writes():
    source = "optim_wrapper = dict(optimizer={'lr': 8e-5}, clip_grad=dict(max_norm=0.5, norm_type=2))\n"
    assert optimiser_literals(source) == [
        (('optim_wrapper', 'optimizer', 'lr'), 8e-5),
        (('optim_wrapper', 'clip_grad', 'max_norm'), 0.5),
        (('optim_wrapper', 'clip_grad', 'norm_type'), 2),
    ]
    assert optimiser_literals('optim_wrapper = _base_.det_optim_wrapper.maskrcnn.b\n') == []


def test_each_optimiser_setting_is_written_once():
    """A size's recipe in one place: what final configs share (gradient clipping, Base's lr, Pale's weight
    decay) lives in the family base's ``det_optim_wrapper`` table, which they take; no optimiser value is
    written in two final configs."""
    written = {}
    for name in ALL_CONFIGS:
        for keys, value in optimiser_literals((CONFIG_DIR / name).read_text()):
            written.setdefault(f'{".".join(keys)}={value!r}', []).append(name)
    repeated = {setting: names for setting, names in written.items() if len(names) > 1}
    assert not repeated, (
        'optimiser settings written in several final configs; put them once in the family base '
        f'(configs/_base_/<family>.py, det_optim_wrapper) and take them from there: {repeated}'
    )


def model_groups():
    """Configs sharing one model: (task, family, size) for the matrix, and the demo alone."""
    groups = {}
    for name in MATRIX:
        p = parts(name)
        groups.setdefault(f"{p['task']}_{p['family']}_{p['size']}", []).append(name)
    groups['demo'] = [DEMO]
    return groups


MODEL_GROUPS = model_groups()


def build_model(cfg):
    """The model of ``cfg`` without ImageNet weights, in ``cfg``'s registry scope."""
    scope = cfg.default_scope
    init_default_scope(scope)
    registry = importlib.import_module(f'{scope}.registry').MODELS
    model_cfg = copy.deepcopy(cfg.model)
    model_cfg.backbone.init_cfg = None
    if scope == 'mmseg':
        model_cfg.data_preprocessor.size = (IMAGE_SIZE, IMAGE_SIZE)  # instead of the 512x512 crop
    if 'roi_head' in model_cfg:  # tiny images with two objects: fewer sampled anchors/RoIs suffice
        model_cfg.train_cfg.rpn.sampler.num = model_cfg.train_cfg.rcnn.sampler.num = 64
    return registry.build(model_cfg)


def detection_batch(model, with_mask):
    from mmdet.structures import DetDataSample
    from mmdet.structures.mask import BitmapMasks
    from mmengine.structures import InstanceData

    size = IMAGE_SIZE
    boxes = torch.tensor([[6.0, 8.0, 40.0, 44.0], [30.0, 20.0, 60.0, 62.0]])
    sample = DetDataSample(metainfo=dict(img_shape=(size, size), ori_shape=(size, size), scale_factor=(1.0, 1.0)))
    sample.gt_instances = InstanceData(bboxes=boxes, labels=torch.tensor([0, 2]))
    if with_mask:
        masks = np.zeros((2, size, size), dtype=np.uint8)
        for mask, (x1, y1, x2, y2) in zip(masks, boxes.int().tolist()):
            mask[y1:y2, x1:x2] = 1
        sample.gt_instances.masks = BitmapMasks(masks, size, size)
    image = torch.randint(0, 256, (3, size, size), dtype=torch.uint8)
    return model.data_preprocessor(dict(inputs=[image], data_samples=[sample]), training=True)


def segmentation_batch(model, batch=2):
    """Two images: the PPM's 1x1 pooled BatchNorm needs more than one value per channel."""
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample

    size, samples = IMAGE_SIZE, []
    for _ in range(batch):
        sample = SegDataSample(metainfo=dict(img_shape=(size, size), ori_shape=(size, size)))
        sample.gt_sem_seg = PixelData(data=torch.randint(0, 150, (1, size, size)))
        samples.append(sample)
    images = [torch.randint(0, 256, (3, size, size), dtype=torch.uint8) for _ in range(batch)]
    return model.data_preprocessor(dict(inputs=images, data_samples=samples), training=True)


def weight_decay_by_name(model, optim_wrapper_cfg):
    wrapper = build_optim_wrapper(model, copy.deepcopy(optim_wrapper_cfg))
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: group['weight_decay'] for group in wrapper.optimizer.param_groups for p in group['params']}


def assert_decay_groups(model, cfg, family):
    """No decay for norms (by type), biases, position tables and global tokens; decay elsewhere."""
    base_decay = cfg.optim_wrapper.optimizer.weight_decay
    decay = weight_decay_by_name(model, cfg.optim_wrapper)
    assert set(decay) == {n for n, p in model.named_parameters() if p.requires_grad}
    norm_params = {
        f'{module_name}.{param_name}'
        for module_name, module in model.named_modules()
        if isinstance(module, NORM_TYPES)
        for param_name, _ in module.named_parameters(recurse=False)
    }
    for name, value in decay.items():
        no_decay = name in norm_params or name.endswith('.bias') or any(key in name for key in NO_DECAY_NAMES)
        assert value == (0.0 if no_decay else base_decay), (name, value)
    linear_weights = [f'{n}.weight' for n, m in model.backbone.named_modules() if isinstance(m, nn.Linear)]
    assert linear_weights and all(decay[f'backbone.{n}'] == base_decay for n in linear_weights)
    # The names the rule above must catch, so the test cannot pass vacuously.
    anchors = dict(
        vil=('relative_position', 'cls_token'),
        vil_ls=('dual_ln', 'relative_position', 'cls_token'),
        pale=('norm',),
        vvt=('norm',),
    )[family]
    for anchor in anchors:
        matching = [n for n in decay if n.startswith('backbone.') and anchor in n]
        assert matching and all(decay[n] == 0.0 for n in matching), anchor


@pytest.mark.parametrize('group', sorted(MODEL_GROUPS))
def test_model_trains_one_iteration(group):
    """Build once, check every config's optimiser groups on it, then one loss + backward."""
    names = MODEL_GROUPS[group]
    cfgs = [load(name) for name in names]
    assert all(cfg.model.to_dict() == cfgs[0].model.to_dict() for cfg in cfgs[1:]), names
    torch.manual_seed(0)
    model = build_model(cfgs[0])
    model.train()
    family = 'vil' if group == 'demo' else parts(names[0])['family']
    for cfg in cfgs:
        assert_decay_groups(model, cfg, family)

    if cfgs[0].default_scope == 'mmseg':
        data = segmentation_batch(model)
    else:
        data = detection_batch(model, with_mask='roi_head' in cfgs[0].model)
    loss, _ = model.parse_losses(model(**data, mode='loss'))
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.backbone.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


# Paper totals (ViL paper, Tables 6-7; Pale paper, Tables 3-4; VVT paper, Table 5). The ViL paper's
# detector counts include the official backbone's unused ImageNet head (1000 x C_last + 1000): with it
# Mask R-CNN and RetinaNet ViL-T/S land within 0.25% of the paper, without it 1-2.5% low. Our detectors
# drop that head, so it is added back.
PAPER_PARAMS_M = [
    ('maskrcnn_vil_t_1x.py', 26.9, True),
    ('maskrcnn_vil_s_1x.py', 45.0, True),
    ('retinanet_vil_s_1x.py', 35.68, True),
    ('maskrcnn_pale_t_1x.py', 41.0, False),
    ('upernet_pale_t_160k_ade20k.py', 52.0, False),
    ('upernet_vvt_s_160k_ade20k.py', 55.5, False),
]


@pytest.mark.parametrize('name,expected_m,with_imagenet_head', PAPER_PARAMS_M)
def test_parameter_count_matches_paper(name, expected_m, with_imagenet_head):
    model = build_model(load(name))
    count = sum(p.numel() for p in model.parameters())
    if with_imagenet_head:
        count += 1000 * model.backbone.embed_dims[-1] + 1000
    assert abs(count / 1e6 - expected_m) / expected_m < 0.02, count / 1e6
