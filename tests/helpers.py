"""Helpers shared by the test files: tiny backbones, output and gradient checks, official checkpoints, op recording."""

import contextlib
import io
import logging
import re

import torch
from mmengine.logging import MMLogger
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import visattn_mm  # noqa: F401  (registration)
from paths import ROOT
from visattn_mm.models import PaleTransformer, ViL, ViLLS, VVT

STRIDES = (4, 8, 16, 32)

# Custom tiny archs (the arch-dict escape hatch): one block per stage, a few channels.
VIL_TINY_ARCH = dict(depths=(1, 1, 1, 1), embed_dims=(16, 32, 32, 32), num_heads=(1, 2, 2, 2))
VVT_TINY_ARCH = dict(depths=(1, 1, 1, 1), embed_dims=(8, 16, 16, 16), num_heads=(1, 2, 2, 4), mlp_ratios=(2, 2, 2, 2))
PALE_TINY_ARCH = dict(depths=(1, 1, 1, 1), embed_dims=(8, 16, 16, 16), num_heads=(2, 2, 2, 4), mlp_ratios=(2, 2, 2, 2))
TINY_ARCHS = {ViL: VIL_TINY_ARCH, ViLLS: VIL_TINY_ARCH, VVT: VVT_TINY_ARCH, PaleTransformer: PALE_TINY_ARCH}
BACKBONES = tuple(TINY_ARCHS)


def build_tiny(cls, **kwargs):
    """``cls`` with its tiny custom arch; ``kwargs`` override the other arguments."""
    return cls(arch=TINY_ARCHS[cls], **kwargs)


def use_tiny_backbone(cfg):
    """Give an mmdet / mmseg config's backbone its tiny arch (no pretrained weights), and
    its neck or decode head (and auxiliary head) the matching ``in_channels``."""
    backbone = cfg.model.backbone
    arch = next(a for cls, a in TINY_ARCHS.items() if cls.__name__ == backbone.type)
    backbone.update(arch=arch, init_cfg=None)
    dims = [arch['embed_dims'][i] for i in backbone.get('out_indices', (0, 1, 2, 3))]
    head = cfg.model.get('neck') or cfg.model.decode_head
    head.in_channels = dims
    if 'auxiliary_head' in cfg.model:
        cfg.model.auxiliary_head.in_channels = dims[2]


def assert_dense_outputs(outs, batch, size, dims, strides=STRIDES):
    """Each output is ``(batch, dim, ceil(H / stride), ceil(W / stride))`` and finite."""
    h, w = size
    assert len(outs) == len(dims)
    for out, stride, dim in zip(outs, strides, dims):
        assert out.shape == (batch, dim, -(-h // stride), -(-w // stride)), (out.shape, stride)
        assert torch.isfinite(out).all()


def assert_finite_grads(model):
    """Every parameter received a finite gradient."""
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def assert_same_gradients(model_a, model_b, x, seed=None, rtol=1e-5, atol=1e-6):
    """Parameter gradients of ``sum(mean(out^2))`` over the :func:`outputs` agree between two models
    (e.g. with_cp on/off).

    ``seed``: reseed before each model's pass, so random draws (e.g. random shift) match.
    """
    grads = []
    for model in (model_a, model_b):
        if seed is not None:
            torch.manual_seed(seed)
        loss = sum(o.pow(2).mean() for o in outputs(model, x))
        grads.append(torch.autograd.grad(loss, list(model.parameters())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def outputs(model, x):
    """``model(x)`` as a tuple: a backbone's maps, or a classifier's logits alone."""
    out = model(x)
    return (out,) if isinstance(out, torch.Tensor) else out


def snapshot(model):
    """A copy of every tensor of ``model.state_dict()``, to compare bit for bit later."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_unchanged(model, before):
    """``model``'s tensors are bit-identical to the :func:`snapshot` ``before``."""
    after = model.state_dict()
    assert set(after) == set(before)
    changed = [k for k, v in after.items() if not torch.equal(v, before[k])]
    assert not changed, f'changed by a failed load: {changed[:5]}'


def official_vil_layout_checkpoint(spec, local_attention, seed=0, img_size=224, best_acc=0.0):
    """An official ViL-family classification checkpoint, written from the official layout (not from our code).

    The layout (docs/backbones.md#official-checkpoint-layouts): ``net`` container, ``module.``
    prefix, ``layerN`` sequentials (0 = patch embedding with ``norm_embed`` and ``cls_token``,
    2j+1 = attention block, 2j+2 = MLP block), patch sizes 4,2,2,2, global tokens 1,1,1,0,
    full-attention stages 3-4 (fused qkv, (2n-1)^2 tables, g2l/g2g biases where the stage has
    global tokens), final norm and 1000-class head.

    Args:
        spec (dict): ``depths``, ``dims``, ``heads``.
        local_attention (callable): ``(net, prefix, dim, heads, num_global, rand)`` writes the
            attention keys of one stage-1/2 block under ``prefix`` (e.g. ``module.layer1.1``).
        seed (int): Seed of the values (``randn * 0.02``; norms ``1 + randn * 0.02``).
        img_size (int): Training size, which fixes the full-attention table sizes.
        best_acc (float): Stored like the official files do.
    """
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen) * 0.02  # noqa: E731
    net, in_dim, side = {}, 3, img_size
    for i, (depth, dim, heads) in enumerate(zip(spec['depths'], spec['dims'], spec['heads'])):
        patch, num_global = (4, 2, 2, 2)[i], (1, 1, 1, 0)[i]
        side //= patch
        layer = f'module.layer{i + 1}'
        net[f'{layer}.0.proj.weight'] = rand(dim, in_dim, patch, patch)
        net[f'{layer}.0.proj.bias'] = rand(dim)
        net[f'{layer}.0.norm_embed.weight'], net[f'{layer}.0.norm_embed.bias'] = 1 + rand(dim), rand(dim)
        if num_global:
            net[f'{layer}.0.cls_token'] = rand(1, num_global, dim)
        for j in range(depth):
            attn, mlp = f'{layer}.{2 * j + 1}', f'{layer}.{2 * j + 2}'
            net[f'{attn}.norm.weight'], net[f'{attn}.norm.bias'] = 1 + rand(dim), rand(dim)
            if i < 2:
                local_attention(net, attn, dim, heads, num_global, rand)
            else:
                net[f'{attn}.attn.qkv.weight'], net[f'{attn}.attn.qkv.bias'] = rand(3 * dim, dim), rand(3 * dim)
                net[f'{attn}.attn.proj.weight'], net[f'{attn}.attn.proj.bias'] = rand(dim, dim), rand(dim)
                net[f'{attn}.attn.local_relative_position_bias_table'] = rand((2 * side - 1) ** 2, heads)
                net[f'{attn}.attn.relative_position_index'] = torch.zeros(side**2, side**2, dtype=torch.long)
                if num_global:
                    add_global_biases(net, attn, heads, num_global, rand)
            net[f'{mlp}.norm.weight'], net[f'{mlp}.norm.bias'] = 1 + rand(dim), rand(dim)
            net[f'{mlp}.mlp.fc1.weight'], net[f'{mlp}.mlp.fc1.bias'] = rand(4 * dim, dim), rand(4 * dim)
            net[f'{mlp}.mlp.fc2.weight'], net[f'{mlp}.mlp.fc2.bias'] = rand(dim, 4 * dim), rand(dim)
        in_dim = dim
    last = spec['dims'][-1]
    net['module.norm.weight'], net['module.norm.bias'] = 1 + rand(last), rand(last)
    net['module.head.weight'], net['module.head.bias'] = rand(1000, last), rand(1000)
    return dict(net=net, arch='official', epoch=300, best_acc=best_acc, optimizer={}, scheduler={})


def add_global_biases(net, attn, heads, num_global, rand):
    """The official g2l (2, heads, G) and g2g (heads, G, G) relative-position biases."""
    net[f'{attn}.attn.g2l_relative_position_bias'] = rand(2, heads, num_global)
    net[f'{attn}.attn.g2g_relative_position_bias'] = rand(heads, num_global, num_global)


def assert_trains_at_size(model, size, batch=2):
    """Training-mode forward at ``size``: strides and finiteness, then finite gradients everywhere.

    Returns the input batch (it requires grad) for further checks.
    """
    x = torch.randn(batch, 3, *size, requires_grad=True)
    outs = model.train()(x)
    assert_dense_outputs(outs, batch, size, model.embed_dims)
    sum(o.pow(2).mean() for o in outs).backward()
    assert_finite_grads(model)
    return x


def build_config_model_on_meta(config_name):
    """``configs/<config_name>``'s model built on the meta device (no memory), its config and parameters (M).

    Built in the config's own registry scope (mmdet or mmseg), ImageNet init_cfg kept (nothing is loaded
    on the meta device).
    """
    import importlib

    from mmengine.config import Config
    from mmengine.registry import init_default_scope

    cfg = Config.fromfile(ROOT / 'configs' / config_name)
    init_default_scope(cfg.default_scope)
    with torch.device('meta'):
        model = importlib.import_module(f'{cfg.default_scope}.registry').MODELS.build(cfg.model)
    return cfg, model, sum(p.numel() for p in model.parameters()) / 1e6


def numbered_layout_names(state_dict, stage_norm):
    """``state_dict`` under the numbered names VVT and Pale had before the shared stage layout
    (``patch_embed{n}``, ``block{n}``, ``norm{n}``, 1-based), written out here independently of
    the library's renaming."""

    def old_name(key):
        stage = re.match(r'stages\.(\d+)\.(patch_embed|blocks|norm)\.(.*)', key)
        if stage:
            n, part, rest = int(stage.group(1)) + 1, stage.group(2), stage.group(3)
            return f'{dict(patch_embed="patch_embed", blocks="block", norm="norm")[part]}{n}.{rest}'
        norm = re.match(r'norm(\d+)\.(.*)', key)
        assert not (norm and stage_norm)
        return f'norm{int(norm.group(1)) + 1}.{norm.group(2)}' if norm else key

    return {old_name(key): value for key, value in state_dict.items()}


def official_vil_checkpoint(spec, seed=0, img_size=224, window=7):
    """An official ViL classification checkpoint (see :func:`official_vil_layout_checkpoint`).

    Sliding-chunk stages 1-2: separate ``query``/``kv``/``proj`` with duplicate ``*_global``
    keys sharing the same tensors, ``(4w-1)^2`` tables and index buffers, g2l/g2g biases.
    """

    def sliding_chunk_keys(net, attn, dim, heads, num_global, rand):
        for name, rows in (('query', dim), ('kv', 2 * dim), ('proj', dim)):
            weight, bias = rand(rows, dim), rand(rows)
            net[f'{attn}.attn.{name}.weight'] = net[f'{attn}.attn.{name}_global.weight'] = weight
            net[f'{attn}.attn.{name}.bias'] = net[f'{attn}.attn.{name}_global.bias'] = bias
        net[f'{attn}.attn.local_relative_position_bias_table'] = rand((4 * window - 1) ** 2, heads)
        net[f'{attn}.attn.relative_position_index'] = torch.zeros(window**2, 9 * window**2, dtype=torch.long)
        add_global_biases(net, attn, heads, num_global, rand)

    return official_vil_layout_checkpoint(spec, sliding_chunk_keys, seed, img_size, best_acc=82.4)


class OpRecorder(TorchDispatchMode):
    """Records every ATen op that runs (forward and backward): name, output dtypes and sizes."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.calls.append((str(func.overloadpacket.__name__), [t.dtype for t in tensors], [t.numel() for t in tensors]))
        return out

    @property
    def max_numel(self):
        return max(n for _, _, sizes in self.calls for n in sizes)


@contextlib.contextmanager
def logged_lines():
    """The lines mmengine's current logger writes inside the block, as a list filled on exit."""
    stream, lines = io.StringIO(), []
    handler = logging.StreamHandler(stream)
    logger = MMLogger.get_current_instance()
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        lines.extend(stream.getvalue().splitlines())
