"""The backbone contract, written once for all four backbones and, where it applies, their timm classifiers.

As timm's tests/test_models.py does it: one table of model factories, then tests parametrized
over it. Every model is built from its tiny custom arch (``helpers.TINY_ARCHS``: one block per
stage, a few channels) and run at small, odd inputs. Where the backbones differ on purpose
(which output norms exist and how they are numbered, BatchNorms), the table says so and the
tests read it; the tests use only the public surface (constructor arguments, forward,
train/eval, named parameters and modules, parameter names, ``out_indices``, ``frozen_stages``,
``embed_dims``, ``strides``, ``num_stages`` and ``stage_modules``).

What stays in the per-model files is what only one model has: official checkpoints,
parameter counts and FLOPs against the papers, attention against the dense references,
model-specific options. Bad constructor arguments: tests/test_config_errors.py.
"""

import re
from dataclasses import dataclass, field

import pytest
import timm
import torch
from timm.layers import DropPath
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._python_dispatch import TorchDispatchMode

import visattn_mm  # noqa: F401  (registers the backbones and the timm names)
from helpers import (
    STRIDES,
    TINY_ARCHS,
    assert_dense_outputs,
    assert_same_gradients,
    assert_trains_at_size,
    numbered_layout_names,
    outputs,
)
from visattn_mm.checkpoint import load_pretrained
from visattn_mm.models import BACKBONES as PACKAGE_BACKBONES
from visattn_mm.models import Classifier, PaleTransformer, ViL, ViLLS, VVT
from visattn_mm.ops.common import clear_device_caches

STEM = 'stages.0.patch_embed.'  # what ``frozen_stages=0`` freezes


@dataclass(frozen=True)
class Family:
    """A backbone, its timm classifier and how its contract differs from the others'.

    Every backbone keeps stage ``i`` under ``stages.{i}.`` and its output norm (if built)
    under ``norm{i}.``.

    Attributes:
        cls (type): The backbone class.
        timm_name (str): Its timm classifier; the name's preset arch is the one whose block
            count is ``num_blocks`` (the tiny arch overrides it elsewhere).
        num_blocks (int): Blocks of that preset, for the drop-path schedule.
        stage_norm (bool): VVT: every built stage ends in a norm (``stages.{i}.norm``) that
            the next stage reads; no output norms. ViL and Pale build an output norm
            ``norm{i}`` only for ``out_indices``.
        num_batchnorms (int): BatchNorms in the tiny arch (Pale: q, k and v of every block).
        classifier_layout (str): ``load_pretrained``'s ``layout`` for a classifier checkpoint.
        kwargs (dict): Constructor arguments of every model of the row.
    """

    cls: type
    timm_name: str
    num_blocks: int
    stage_norm: bool
    num_batchnorms: int
    classifier_layout: str
    kwargs: dict = field(default_factory=dict)

    @property
    def embed_dims(self):
        return TINY_ARCHS[self.cls]['embed_dims']

    @staticmethod
    def stage_prefixes(i):
        """Name prefixes of stage ``i``'s parameters, its output norm included."""
        return f'stages.{i}.', f'norm{i}.'

    def norm_prefix(self, i):
        """Name prefix of the norm whose output is stage ``i``'s map."""
        return f'stages.{i}.norm.' if self.stage_norm else f'norm{i}.'


FAMILIES = {
    'ViL': Family(ViL, 'vil_small', 12, stage_norm=False, num_batchnorms=0, classifier_layout='ours'),
    # Two global tokens in stage 2: the family's contract covers a non-default count too.
    'ViLLS': Family(
        ViLLS,
        'vil_ls_medium',
        22,
        stage_norm=False,
        num_batchnorms=0,
        classifier_layout='ours',
        kwargs=dict(num_global_tokens=(1, 2, 1, 0)),
    ),
    'VVT': Family(VVT, 'vvt_small', 18, stage_norm=True, num_batchnorms=0, classifier_layout='vvt'),
    'PaleTransformer': Family(
        PaleTransformer, 'pale_tiny', 22, stage_norm=False, num_batchnorms=3 * 4, classifier_layout='pale'
    ),
}
NUM_CLASSES = 5
SIZE = (64, 96)  # (H, W): not square, not a multiple of 32; Pale's stage 4 has 2x3 values per channel


def build(family, kind, **kwargs):
    """A model of the table: the tiny ``'backbone'`` or its timm ``'classifier'``."""
    kwargs = dict(family.kwargs, arch=TINY_ARCHS[family.cls], **kwargs)
    if kind == 'backbone':
        return family.cls(**kwargs)
    return timm.create_model(family.timm_name, num_classes=NUM_CLASSES, **kwargs)


def backbone_of(model):
    return model.backbone if isinstance(model, Classifier) else model


def key_prefix(model):
    """What the backbone's parameter names are prefixed with in ``model``."""
    return 'backbone.' if isinstance(model, Classifier) else ''


BACKBONES = [pytest.param(family, 'backbone', id=name) for name, family in FAMILIES.items()]
CLASSIFIERS = [pytest.param(family, 'classifier', id=family.timm_name) for family in FAMILIES.values()]
MODELS = BACKBONES + CLASSIFIERS


def names_under(model, prefixes):
    """Names of ``model``'s parameters under any of the backbone-relative ``prefixes``."""
    prefixes = tuple(key_prefix(model) + p for p in prefixes)
    return {name for name, _ in model.named_parameters() if name.startswith(prefixes)}


# ---- Outputs, shapes, strides, channels ----

# Odd, prime, non-square, smaller than a stride or a window, much wider than high.
ANY_SIZES = [(37, 53), (112, 137), (1, 1), (5, 300), (64, 33), (29, 19)]


SIZE_CASES = [  # every size for the backbones; the classifiers' timm checks run at SIZE already
    *[pytest.param(*p.values, size, id=f'{p.id}-{size[0]}x{size[1]}') for p in BACKBONES for size in ANY_SIZES],
    *[
        pytest.param(*p.values, size, id=f'{p.id}-{size[0]}x{size[1]}')
        for p in CLASSIFIERS
        for size in ((1, 1), (5, 300), (29, 19))
    ],
]


def test_every_backbone_of_the_package_has_a_row():
    """A backbone added to visattn_mm.models.FAMILIES fails here until the suite knows its facts."""
    assert set(FAMILIES) == set(PACKAGE_BACKBONES)


@pytest.mark.parametrize('family,kind,size', SIZE_CASES)
def test_any_size_trains_and_evaluates(family, kind, size):
    """Training: outputs of ``(2, C_i, ceil(H / s_i), ceil(W / s_i))`` (the classifier: logits),
    a finite gradient for every parameter and the input; eval without grad: the same shapes."""
    torch.manual_seed(0)
    model = build(family, kind, drop_path_rate=0.1)
    backbone = backbone_of(model)
    assert backbone.num_stages == 4 and backbone.strides == STRIDES and backbone.embed_dims == family.embed_dims
    if kind == 'backbone':
        assert model.out_indices == (0, 1, 2, 3)
        x = assert_trains_at_size(model, size)
    else:
        assert model.backbone.out_indices == (3,)
        x = torch.randn(2, 3, *size, requires_grad=True)
        logits = model.train()(x)
        assert logits.shape == (2, NUM_CLASSES) and torch.isfinite(logits).all()
        logits.pow(2).mean().backward()
        assert [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()] == []
    assert torch.isfinite(x.grad).all()

    model.eval()
    with torch.no_grad():
        outs = outputs(model, x.detach())
    if kind == 'backbone':
        assert_dense_outputs(outs, 2, size, family.embed_dims)
    else:
        assert outs[0].shape == (2, NUM_CLASSES) and torch.isfinite(outs[0]).all()


@pytest.mark.parametrize('family,kind', MODELS)
def test_input_that_is_not_an_image_batch_is_a_clear_error(family, kind):
    model = build(family, kind).eval()
    with pytest.raises(ValueError, match=r'expects an NCHW image batch, got shape \(3, 32, 32\)'):
        model(torch.randn(3, 32, 32))


@pytest.mark.parametrize('family,kind', BACKBONES)
def test_a_mistyped_argument_names_the_backbone(family, kind):
    """The standard arguments reach DenseBackbone.__init__ through ``**kwargs``; a typo among them still
    names the class the user built, as Python would for an argument of its own."""
    name = family.cls.__name__
    with pytest.raises(TypeError, match=rf"^{name}\.__init__\(\) got an unexpected keyword argument 'out_indice'$"):
        build(family, kind, out_indice=(0,))


# ---- out_indices: which outputs, which stages and norms are built, every built parameter trains ----


@pytest.mark.parametrize('out_indices', [(1, 2), (0, 3), (2,), (0,)])
@pytest.mark.parametrize('family,kind', BACKBONES)
def test_out_indices_select_outputs_and_build_only_what_they_need(family, kind, out_indices):
    """Outputs of exactly ``out_indices``; the stages up to the last output and the output norms
    the table says are built, ``stage_modules(i)`` holding exactly stage i's parameters; after a
    backward pass every parameter has a gradient (DDP without find_unused_parameters)."""
    torch.manual_seed(0)
    model = build(family, kind, out_indices=out_indices).train()
    last = max(out_indices)
    num_built = last + 1
    assert model.out_indices == out_indices and model.num_stages == num_built
    assert model.embed_dims == family.embed_dims[:num_built] and model.strides == STRIDES[:num_built]

    normed = range(num_built) if family.stage_norm else out_indices
    norms = {name for name, _ in model.named_parameters() if re.match(r'(?:norm\d+|stages\.\d+\.norm)\.', name)}
    assert norms == {family.norm_prefix(i) + p for i in normed for p in ('weight', 'bias')}
    names = {name for name, _ in model.named_parameters()}
    for i in range(4):
        in_stage = names_under(model, family.stage_prefixes(i))
        assert bool(in_stage) == (i < num_built), i
        if i < num_built:
            parameters = {id(p) for module in model.stage_modules(i) for p in module.parameters()}
            assert parameters == {id(p) for name, p in model.named_parameters() if name in in_stage}, i
    assert names == set().union(*(names_under(model, family.stage_prefixes(i)) for i in range(4)))

    x = torch.randn(2, 3, *SIZE)
    outs = model(x)
    strides = [STRIDES[i] for i in out_indices]
    assert_dense_outputs(outs, 2, SIZE, [family.embed_dims[i] for i in out_indices], strides)
    sum(o.pow(2).mean() for o in outs).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---- frozen_stages ----

ALL_OUTPUTS = (0, 1, 2, 3)
FROZEN_CASES = [  # (frozen_stages, out_indices); a classifier's one output is the last stage
    *[
        pytest.param(*p.values, frozen, out, id=f'{p.id}-{frozen}-{"".join(map(str, out))}')
        for p in BACKBONES
        for frozen, out in (
            (-1, ALL_OUTPUTS),
            (0, ALL_OUTPUTS),
            (1, (1, 2, 3)),
            (2, ALL_OUTPUTS),
            (2, (1, 2)),
            (4, ALL_OUTPUTS),
        )
    ],
    *[pytest.param(*p.values, frozen, None, id=f'{p.id}-{frozen}') for p in CLASSIFIERS for frozen in (2, 4)],
]


@pytest.mark.parametrize('family,kind,frozen_stages,out_indices', FROZEN_CASES)
def test_frozen_stages(family, kind, frozen_stages, out_indices):
    """-1 freezes nothing; 0 the first patch embedding; i stages 1..i with their output norms.
    Frozen already at build (DDP sees them as frozen), kept in eval by ``train()``, no gradient;
    every other parameter trains and gets one, every other module trains."""
    kwargs = dict(frozen_stages=frozen_stages, drop_path_rate=0.5)
    if out_indices is not None:
        kwargs['out_indices'] = out_indices
    torch.manual_seed(0)
    model = build(family, kind, **kwargs)
    backbone = backbone_of(model)
    assert backbone.frozen_stages == frozen_stages
    prefixes = (STEM,) if frozen_stages >= 0 else ()
    prefixes += sum((family.stage_prefixes(i) for i in range(frozen_stages)), ())
    frozen = names_under(model, prefixes)
    assert bool(frozen) == (frozen_stages >= 0)
    assert {name for name, p in model.named_parameters() if not p.requires_grad} == frozen  # at build

    model.train()
    assert {name for name, p in model.named_parameters() if not p.requires_grad} == frozen
    frozen_modules = tuple(key_prefix(model) + p.rstrip('.') for p in prefixes)
    for name, module in model.named_modules():
        in_frozen = any(name == m or name.startswith(m + '.') for m in frozen_modules)
        assert module.training != in_frozen, name

    x = torch.randn(2, 3, *SIZE, requires_grad=True)  # a graph even when everything is frozen
    sum(o.pow(2).mean() for o in outputs(model, x)).backward()
    assert {name for name, p in model.named_parameters() if p.grad is None} == frozen


# ---- norm_eval ----


@pytest.mark.parametrize('norm_eval', [True, False])
@pytest.mark.parametrize('family,kind', MODELS)
def test_norm_eval_keeps_batchnorms_in_eval(family, kind, norm_eval):
    """``norm_eval=True``: after ``train()`` every BatchNorm is in eval and its statistics stay as
    they are (a batch of one 32x32 image then trains, 1 value per channel at stride 32); every
    other module trains. ``False``: the BatchNorms train and update their statistics."""
    model = build(family, kind, norm_eval=norm_eval).train()
    batchnorms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    assert len(batchnorms) == family.num_batchnorms
    for module in model.modules():
        assert module.training == (not (norm_eval and isinstance(module, _BatchNorm)))
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in batchnorms]
    x = torch.randn(1, 3, 32, 32) if norm_eval else torch.randn(2, 3, *SIZE)
    outputs(model, x)
    changed = [
        any(not torch.equal(v, m.state_dict()[k]) for k, v in stats.items()) for stats, m in zip(before, batchnorms)
    ]
    assert changed == [not norm_eval] * len(batchnorms)


# ---- with_cp ----


def count_saved_tensors(model, x):
    """Tensors a forward pass of ``model`` saves for backward outside of checkpointed blocks."""
    count = 0

    def pack(tensor):
        nonlocal count
        count += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs(model, x)
    return count


@pytest.mark.parametrize(
    'family,kind,training',
    [
        *[
            pytest.param(*p.values, training, id=f'{p.id}-{mode}')
            for p in BACKBONES
            for training, mode in ((True, 'train'), (False, 'eval'))
        ],
        *[pytest.param(*p.values, True, id=p.id) for p in CLASSIFIERS],
    ],
)
def test_gradient_checkpointing_saves_memory_and_gives_the_same_gradients(family, kind, training):
    """``with_cp=True`` (a classifier: timm's ``set_grad_checkpointing()``): fewer tensors saved
    for backward, the same gradients (train: BatchNorm batch statistics, eval: fixed ones)."""
    torch.manual_seed(0)
    plain = build(family, kind, drop_path_rate=0.0)
    torch.manual_seed(0)
    if kind == 'backbone':
        checkpointed = build(family, kind, drop_path_rate=0.0, with_cp=True)
    else:
        checkpointed = build(family, kind, drop_path_rate=0.0)
        checkpointed.set_grad_checkpointing()
    for key, value in plain.state_dict().items():
        assert torch.equal(value, checkpointed.state_dict()[key]), key
    plain.train(training)
    checkpointed.train(training)
    x = torch.randn(2, 3, *SIZE, requires_grad=True)
    assert count_saved_tensors(checkpointed, x) < count_saved_tensors(plain, x)
    assert_same_gradients(plain, checkpointed, x)


# ---- no host synchronisation ----

# ATen ops that make the host wait for a CUDA device: reading a value back, sizing an output by
# the data, or making a tensor of Python data (lift_fresh: e.g. an index list) that a GPU op then
# needs, a copy from pageable host memory.
SYNCING_OPS = frozenset(
    {
        'lift_fresh',
        '_local_scalar_dense',
        'item',
        'is_nonzero',
        'equal',
        'nonzero',
        'nonzero_static',
        'masked_select',
        'unique',
        '_unique',
        '_unique2',
        'unique_consecutive',
        'unique_dim',
        'bincount',
        'histc',
        'to_list',
    }
)


class SyncingOpRecorder(TorchDispatchMode):
    """Records the ops of :data:`SYNCING_OPS` that run (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNCING_OPS:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _train_and_evaluate(model, image):
    model.train()
    sum(out.sum() for out in outputs(model, image)).backward()
    model.eval()
    with torch.no_grad():
        model(image)


@pytest.mark.parametrize('impl', ['fast', 'math'])
@pytest.mark.parametrize('family,kind', BACKBONES)
def test_forward_and_backward_never_wait_for_the_device(family, kind, impl):
    """No op that would make the host wait for a GPU runs in a training step (forward and backward)
    or an evaluation, once the first call has cached the per-size constants. ViL's random shift
    draws on the CPU generator, so it is off here; the CUDA test in tests/test_cuda.py runs all of it
    under PyTorch's sync debug mode."""
    model = build(family, kind, attn_impl=impl)
    image = torch.randn(2, 3, 45, 61)
    _train_and_evaluate(model, image)
    with SyncingOpRecorder() as recorder:
        _train_and_evaluate(model, image)
    assert recorder.ops == []
    with SyncingOpRecorder() as recorder:  # the recorder sees such ops (the check can fail)
        torch.ones(3).sum().item()
        torch.ones(3).nonzero()
        torch.ones(3)[[0, 2]]  # an index list: a tensor made of Python data
    assert recorder.ops == ['_local_scalar_dense', 'nonzero', 'lift_fresh']


@pytest.mark.parametrize('impl', ['fast', 'math'])
@pytest.mark.parametrize('family,kind', BACKBONES)
def test_training_works_after_an_inference_mode_evaluation(family, kind, impl):
    """The per-size constants (masks, indices, weights) are cached at their first use, which may be an
    evaluation under ``torch.inference_mode()``; autograd must still be able to save them when training
    follows (they were inference tensors before: "cannot be saved for backward")."""
    model = build(family, kind, attn_impl=impl)
    image = torch.randn(2, 3, 45, 61)
    clear_device_caches()
    model.eval()
    with torch.inference_mode():
        model(image)
    model.train()
    sum(out.sum() for out in outputs(model, image)).backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- drop path ----


@pytest.mark.parametrize('family,kind', MODELS)
def test_drop_path_rises_linearly_over_all_blocks(family, kind):
    """The family's preset arch (its timm name's), on the meta device: 0 for the first block
    (no DropPath), then ``linspace(0, 0.3, num_blocks)``, block by block in order."""
    preset = family.timm_name.rsplit('_', 1)[1]
    with torch.device('meta'):
        if kind == 'backbone':
            model = family.cls(arch=preset, drop_path_rate=0.3)
        else:
            model = timm.create_model(family.timm_name, drop_path_rate=0.3)
    rates = [m.drop_prob for m in model.modules() if isinstance(m, DropPath)]
    assert rates == pytest.approx(torch.linspace(0, 0.3, family.num_blocks).tolist()[1:])


# ---- layer-wise learning-rate decay ----


@pytest.mark.parametrize('family,kind', CLASSIFIERS)
def test_layer_depths_are_timms_layer_decay_groups(family, kind):
    """get_layer_depth (mmpretrain's form, for layer-decay constructors) puts every parameter in the
    group timm's own layer decay gives it through the classifier's group_matcher: the stem first, a
    group per block in order, the head last."""
    from timm.models import group_parameters

    model = build(family, kind)
    groups = group_parameters(model, model.group_matcher())
    group_of = {name: index for index, names in groups.items() for name in names}
    depths = {name: model.backbone.get_layer_depth(name, 'backbone.') for name, _ in model.named_parameters()}
    assert depths == {name: (group_of[name], len(groups)) for name in depths}
    assert len(groups) == sum(len(stage.blocks) for stage in model.backbone.stages) + 2


@pytest.mark.parametrize('family,kind', BACKBONES)
def test_layer_depth_of_a_dense_model(family, kind):
    """In a detector, the backbone's parameters under their prefix and everything else (neck, heads) last."""
    model = build(family, kind)
    num_layers = sum(len(stage.blocks) for stage in model.stages) + 2
    depths = [model.get_layer_depth(f'backbone.{name}', 'backbone.')[0] for name, _ in model.named_parameters()]
    assert min(depths) == 0 and max(depths) == num_layers - 2
    assert model.get_layer_depth('neck.lateral_convs.0.conv.weight', 'backbone.') == (num_layers - 1, num_layers)
    assert model.get_layer_depth('stages.0.patch_embed.proj.weight') == (0, num_layers)


# ---- init_cfg: a classifier's checkpoint initialises the dense backbone ----


@pytest.mark.parametrize('family,kind', BACKBONES)
def test_classifier_checkpoint_initialises_the_backbone_through_init_cfg(family, kind, tmp_path):
    """Through ``init_cfg`` and ``load_pretrained``: every backbone tensor of the classifier,
    nothing missing or unexpected, only the head dropped; the dense backbone's output norms a
    classifier has not (it has only the last one; VVT's norms are stage parts) stay fresh."""
    torch.manual_seed(0)
    classifier = Classifier(
        backbone_type=family.cls.__name__, arch=TINY_ARCHS[family.cls], num_classes=10, **family.kwargs
    )
    path = tmp_path / 'classifier.pth'
    torch.save({'state_dict': classifier.state_dict()}, path)
    expected = classifier.backbone.state_dict()

    dense = build(family, kind, init_cfg=dict(type='Pretrained', checkpoint=str(path)))
    assert any(not torch.equal(v, expected[k]) for k, v in dense.state_dict().items() if k in expected)
    dense.init_weights()
    own = dense.state_dict()
    for key, value in expected.items():
        assert torch.equal(own[key], value), key

    report = load_pretrained(dense, str(path))
    assert report.container == 'state_dict+backbone.' and report.layout == family.classifier_layout
    assert report.missing == [] and report.unexpected == [] and report.mismatched == {}
    assert set(report.dropped) <= {'head.weight', 'head.bias'}
    fresh = set() if family.stage_norm else {family.norm_prefix(i) + p for i in range(3) for p in ('weight', 'bias')}
    assert set(report.fresh) == fresh
    assert set(own) == set(expected) | fresh


@pytest.mark.parametrize('family,kind', BACKBONES)
def test_classifier_checkpoint_loads_into_a_backbone_with_fewer_stages(family, kind, tmp_path):
    """``out_indices=(0, 1)`` builds two stages: a four-stage classifier checkpoint loads with nothing
    missing or unexpected; the tensors of stages 3-4 are dropped, saying why, with the head."""
    torch.manual_seed(0)
    classifier = Classifier(
        backbone_type=family.cls.__name__, arch=TINY_ARCHS[family.cls], num_classes=10, **family.kwargs
    )
    path = tmp_path / 'classifier.pth'
    torch.save({'state_dict': classifier.state_dict()}, path)
    dense = build(family, kind, out_indices=(0, 1))
    report = load_pretrained(dense, str(path))
    assert report.missing == [] and report.unexpected == [] and report.mismatched == {}
    unbuilt = {
        key
        for key in classifier.backbone.state_dict()
        if any(key.startswith(prefix) for i in (2, 3) for prefix in family.stage_prefixes(i))
    }
    assert unbuilt and set(report.dropped) - {'head.weight', 'head.bias'} == unbuilt
    assert {report.dropped[key] for key in unbuilt} == {'stage not built (after the last out_indices)'}
    expected = classifier.backbone.state_dict()
    for key, value in dense.state_dict().items():
        assert key in report.fresh or torch.equal(value, expected[key]), key


@pytest.mark.parametrize('family,kind', [p for p in BACKBONES if p.values[0].cls.numbered_layout])
def test_checkpoint_of_the_numbered_layout_loads_renamed(family, kind):
    """VVT and Pale files saved with the numbered names load on every path: ``load_state_dict``
    (strict, through the load pre-hook, as mmengine's load_from) and ``load_pretrained``, whose
    report lists each rename."""
    torch.manual_seed(0)
    source = build(family, kind, out_indices=(1, 3))
    torch.manual_seed(1)
    target = build(family, kind, out_indices=(1, 3))
    old = numbered_layout_names(source.state_dict(), family.stage_norm)
    assert set(old).isdisjoint(source.state_dict())
    target.load_state_dict(old)
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
    torch.manual_seed(1)
    target = build(family, kind, out_indices=(1, 3))
    report = load_pretrained(target, old)
    assert report.missing == [] and report.unexpected == [] and report.loaded == []
    assert {old_key: new for new, old_key in report.renamed.items()} == dict(zip(old, source.state_dict()))
    assert 'renamed from an older layout: ' in report.summary()
    for key, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[key], value), key
