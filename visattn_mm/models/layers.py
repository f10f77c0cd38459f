"""Small building blocks shared by the backbone skeletons."""

import logging
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from mmengine.logging import print_log
from timm.layers import trunc_normal_

from ..ops.common import builds_for_every_size
from ..ops.cuda_defaults import describe_cuda_defaults
from ..ops.impl import ATTENTION_IMPLS, describe_impl, get_attention_impl


def autocast_dtype(x):
    """The dtype autocast would run a matrix product of ``x`` in: its autocast dtype for a
    16/32-bit float ``x`` under autocast on ``x``'s device, else ``x.dtype`` (also on devices autocast
    does not know, e.g. 'meta')."""
    floating = x.dtype in (torch.float32, torch.float16, torch.bfloat16)
    if floating and torch.amp.is_autocast_available(x.device.type) and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def summed_over_tokens(grad, x):
    """``sum over tokens of grad^T x`` for ``(..., C_out)`` and ``(..., C_in)`` tensors: a linear
    layer's weight gradient, without copying a ``(B, N, C)`` pair into rows where no ``(B*N, C)``
    view can show them (gradients reach the blocks channel-first, from the NCHW outputs): a
    batched product reads them as they are."""
    if grad.dim() == 3 and not all(t.stride(0) == t.shape[1] * t.stride(1) for t in (grad, x)):
        return (grad.transpose(1, 2) @ x).sum(0)
    return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def gelu_linear_grads(grad, gelu_input, weight, needs_input_grad):
    """The gradients of ``linear(gelu(gelu_input), weight, bias)`` (input, weight, bias; ``None``
    where ``needs_input_grad`` says no), recomputing the GELU from its input."""
    needs_input, needs_weight, needs_bias = needs_input_grad
    if needs_input:  # once: `grad @ weight` would copy a gradient that reaches the block channel-first
        grad = grad.contiguous()
    grad_input = torch.ops.aten.gelu_backward(grad @ weight, gelu_input) if needs_input else None
    grad_weight = summed_over_tokens(grad, F.gelu(gelu_input)) if needs_weight else None
    grad_bias = grad.sum(tuple(range(grad.dim() - 1))) if needs_bias else None
    return grad_input, grad_weight, grad_bias


class GeluLinear(torch.autograd.Function):
    """``linear(gelu(x), weight, bias)`` keeping ``x`` and ``weight`` for backward, not the GELU's
    output: autograd would keep both hidden-wide tensors; backward here recomputes the GELU
    (one elementwise pass). The forward computes exactly what the modules do. All tensors share
    one dtype (the caller casts, as autocast would)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(F.gelu(x), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        with torch.autocast(x.device.type, enabled=False):
            return gelu_linear_grads(grad, x, weight, ctx.needs_input_grad)


def keeps_gelu_input_only(mlp):
    """Whether an MLP (``act``, ``fc2``, ``drop``) may run its GELU and ``fc2`` as
    :class:`GeluLinear` now: a gradient will be taken, the activation is the exact GELU, ``fc2``
    has a bias and no dropout acts between them."""
    return (
        torch.is_grad_enabled()
        and type(mlp.act) is nn.GELU
        and mlp.act.approximate == 'none'
        and mlp.fc2.bias is not None
        and not (mlp.training and mlp.drop.p > 0)
    )


class Mlp(nn.Module):
    """fc1 -> GELU -> dropout -> fc2 -> dropout (official key names ``fc1``/``fc2``).

    In training (without dropout) the GELU and ``fc2`` run as :class:`GeluLinear`, which keeps one
    hidden-wide tensor for backward instead of two.
    """

    def __init__(self, dim, hidden_dim, drop=0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        x = self.fc1(x)
        if not keeps_gelu_input_only(self):
            return self.drop(self.fc2(self.drop(self.act(x))))
        dtype = autocast_dtype(x)
        return GeluLinear.apply(x.to(dtype), self.fc2.weight.to(dtype), self.fc2.bias.to(dtype))


def pad_to_multiple(x, multiple):
    """Zero-pad an NCHW map at the bottom/right so both sides divide ``multiple``."""
    h, w = x.shape[-2:]
    pad_h, pad_w = -h % multiple, -w % multiple
    # A graph traced for every size pads always (by zero where the sides divide).
    if builds_for_every_size(pad_h, pad_w) or pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h))
    return x


def linear_drop_path_rates(drop_path_rate, depths):
    """Stochastic-depth rate of every block, rising linearly from 0 to ``drop_path_rate``.

    Computed as the official ViL/VVT code does (``torch.linspace``), so the
    rates match theirs to the last bit; on the CPU explicitly, so that models
    built under ``torch.device('meta')`` (parameter counting) still get numbers.
    """
    return torch.linspace(0, drop_path_rate, sum(depths), device='cpu').tolist()


def init_transformer_weights(module):
    """timm/ViT initialisation: trunc-normal(0.02) Linear weights, zero biases, unit norms."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def _is_int(value):
    # bool is an int subclass, but True as a window size or stage index is a config mistake
    return isinstance(value, int) and not isinstance(value, bool)


def check_attn_impl(attn_impl, name, attention_ops=()):
    """Validate a backbone's ``attn_impl`` and log what it computes (once, when the backbone is built).

    Args:
        attn_impl (str): The backbone's argument.
        name (str): The backbone's name, for the messages.
        attention_ops (tuple): The backbone's ``attention_ops`` (op specs): where 'auto' is in force, the log
            line says what each runs on CUDA per dtype (the environment report says on what evidence).

    Raises:
        ValueError: If ``attn_impl`` is not one of ``ATTENTION_IMPLS``.
    """
    if attn_impl not in ATTENTION_IMPLS:
        raise ValueError(
            f'{name}: attn_impl={attn_impl!r}; allowed: {ATTENTION_IMPLS} '
            "(see visattn_mm.ops.impl; 'auto' picks per device)"
        )
    # What the line speaks of: the backbone's softmax attentions and / or its vicinity attention (no bias).
    softmax = any(op.softmax for op in attention_ops) or not attention_ops
    vicinity = any(not op.softmax for op in attention_ops) or not attention_ops
    line = f'{name}: {describe_impl(attn_impl, softmax, vicinity)}'
    if attn_impl == 'auto' and get_attention_impl() == 'auto' and attention_ops:
        # The rows' evidence is the environment report's (it would make this line 1,500 characters long).
        line += (
            '; on CUDA: '
            + '; '.join(describe_cuda_defaults(op.name, evidence=False) for op in attention_ops)
            + ' (why: python tools/collect_env.py on the GPU machine)'
        )
    print_log(line, logger='current')
    return attn_impl


def check_int(value, arg, name, minimum=1):
    """Raise a ValueError naming ``arg`` unless ``value`` is an int ``>= minimum``."""
    if not _is_int(value) or value < minimum:
        raise ValueError(f'{name}: {arg}={value!r} must be an int >= {minimum}')
    return value


def check_mlp_ratio(ratio, arg, name, dim):
    """Raise a ValueError naming ``arg`` unless ``ratio`` gives a ``dim``-channel MLP hidden units.

    The hidden width is ``int(dim * ratio)``, so ``ratio`` must be a number > 0
    large enough for at least one unit (0 or a negative ratio would build an
    MLP without hidden units, silently).
    """
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, (int, float))
        or not 0 < ratio < math.inf
        or int(dim * ratio) < 1
    ):
        raise ValueError(
            f'{name}: {arg}={ratio!r} must be a number > 0 giving the {dim}-channel '
            f'MLP at least one hidden unit (hidden width int({dim} x ratio)); '
            f'the papers use 4 or 8'
        )
    return ratio


def check_arch(arch, arch_zoo, required_keys, name):
    """Resolve an ``arch`` preset name (or alias) or validate a custom dict.

    A custom dict needs ``required_keys``; its ``depths`` entries must be ints
    ``>= 0`` and its ``embed_dims`` / ``num_heads`` entries ints ``>= 1``, one per
    stage.
    """
    if isinstance(arch, str):
        key = arch.lower()
        if key not in arch_zoo:
            raise ValueError(
                f'{name}: unknown arch {arch!r}; choose one of {sorted(arch_zoo)} '
                f'or pass a dict with keys {sorted(required_keys)}'
            )
        return dict(arch_zoo[key])
    if not isinstance(arch, dict):
        raise ValueError(f'{name}: arch must be a preset name or a dict, got {type(arch).__name__}')
    missing = set(required_keys) - set(arch)
    if missing:
        raise ValueError(f'{name}: custom arch dict is missing {sorted(missing)} (needs {sorted(required_keys)})')
    for key, minimum in (('depths', 0), ('embed_dims', 1), ('num_heads', 1)):
        values = arch.get(key, ())
        if not isinstance(values, (list, tuple)):
            raise ValueError(f'{name}: arch[{key!r}] must be a list or tuple with one entry per stage, got {values!r}')
        for i, value in enumerate(values):
            check_int(value, f'arch[{key!r}][{i}]', name, minimum)
    return dict(arch)


def check_stage_lengths(name, num_stages, **per_stage):
    """Raise a ValueError unless every keyword is a list/tuple with one entry per stage."""
    for arg, values in per_stage.items():
        if not isinstance(values, (list, tuple)) or len(values) != num_stages:
            raise ValueError(f'{name}: {arg} needs {num_stages} entries (one per stage), got {values!r}')


def check_stage_args(name, num_stages, out_indices, frozen_stages, drop_path_rate):
    """Validate the arguments every backbone takes, at build time.

    Args:
        name (str): The backbone's name, for the messages.
        num_stages (int): Stages of the arch.
        out_indices (Sequence[int]): Must be a non-empty set of distinct stage
            indices in ``[0, num_stages)``.
        frozen_stages (int): Must be an int in ``[-1, built stages]``; the backbones
            build the stages up to ``max(out_indices)``.
        drop_path_rate (float): Must be a number in ``[0, 1)``.

    Returns:
        tuple[int]: ``out_indices`` as a tuple.
    """
    allowed = tuple(range(num_stages))
    if not isinstance(out_indices, (list, tuple)):
        raise ValueError(f'{name}: out_indices={out_indices!r} must be a list or tuple of stage indices from {allowed}')
    out_indices = tuple(out_indices)
    if (
        not out_indices
        or len(set(out_indices)) != len(out_indices)
        or any(not _is_int(i) or not 0 <= i < num_stages for i in out_indices)
    ):
        raise ValueError(f'{name}: out_indices={out_indices} must be a non-empty subset of {allowed} without repeats')
    limit = max(out_indices) + 1
    if not _is_int(frozen_stages) or not -1 <= frozen_stages <= limit:
        built = '' if limit == num_stages else f' ({limit} stages are built for out_indices={out_indices})'
        raise ValueError(f'{name}: frozen_stages={frozen_stages!r} must be an int in [-1, {limit}]{built}')
    if isinstance(drop_path_rate, bool) or not isinstance(drop_path_rate, (int, float)) or not 0 <= drop_path_rate < 1:
        raise ValueError(f'{name}: drop_path_rate={drop_path_rate!r} must be a number in [0, 1)')
    if list(out_indices) != sorted(out_indices):
        print_log(
            f'{name}: out_indices={out_indices}: the maps come in stage order, {tuple(sorted(out_indices))}, '
            "as mmdet's and mmseg's backbones return them",
            logger='current',
            level=logging.WARNING,
        )
    return out_indices


class OverlapPatchEmbed(nn.Module):
    """Overlapping conv patch embedding (VVT) / patch merging (Pale) + LayerNorm.

    Kernel ``k``, stride ``s`` and padding ``k // 2``, so output sides are
    ``ceil(H / s)`` for every odd ``k = 2s - 1`` (7/4 and 3/2) and any input size.
    Returns the ``(B, H*W, C)`` tokens and ``(H, W)``.
    """

    def __init__(self, in_channels, dim, kernel_size, stride, eps=1e-5):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size, stride, padding=kernel_size // 2)
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x):
        x = self.proj(x)
        h, w = x.shape[-2:]
        return self.norm(x.flatten(2).transpose(1, 2)), (h, w)
