"""Vicinity Vision Transformer (VVT) backbone for dense prediction.

Paper: "Vicinity Vision Transformer" (Sun et al., TPAMI 2023); official code
OpenNLPLab/Vicinity-Vision-Transformer (built on PVTv2). Four stages
``stages.{i}``; each is an overlapping patch embedding (conv + LayerNorm),
pre-LN blocks of vicinity attention and a PVTv2 conv-FFN, and a stage LayerNorm
``norm`` whose output both feeds the next stage and is the stage's multi-scale
output (strides 4, 8, 16, 32).

The official code names these ``patch_embed{n}``, ``block{n}.{j}`` and ``norm{n}``
(1-based); its checkpoints load with those keys renamed (``numbered_layout``) and
their classification ``head`` dropped.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath

from ..ops.conv_gelu import depthwise_conv_gelu, depthwise_conv_gelu_backward
from ..ops.specs import VICINITY
from ..ops.vicinity import lean_signed_clamp, preserve_features, vicinity_attention
from .base import DenseBackbone, Stage, drop_head_and_unbuilt_stages, rename_numbered_stage_keys, with_aliases
from .layers import (
    OverlapPatchEmbed,
    autocast_dtype,
    check_attn_impl,
    check_int,
    gelu_linear_grads,
    init_transformer_weights,
    keeps_gelu_input_only,
    summed_over_tokens,
)

ARCH_ZOO = with_aliases(
    {
        'tiny': dict(
            depths=(2, 2, 2, 2), embed_dims=(96, 160, 320, 512), num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4)
        ),
        'small': dict(
            depths=(3, 3, 9, 3), embed_dims=(96, 160, 320, 512), num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4)
        ),
        'medium': dict(
            depths=(3, 3, 27, 3), embed_dims=(96, 160, 320, 512), num_heads=(1, 2, 5, 8), mlp_ratios=(8, 8, 4, 4)
        ),
        'large': dict(
            depths=(4, 4, 36, 4), embed_dims=(96, 160, 320, 512), num_heads=(1, 2, 5, 8), mlp_ratios=(4, 4, 4, 4)
        ),
    }
)

DEFAULT_MLP_RATIO = 4  # per stage, for custom arch dicts without ``mlp_ratios``
EMBED_LN_EPS = 1e-5  # patch-embedding LayerNorm (official: nn.LayerNorm default)
LN_EPS = 1e-6  # every other LayerNorm of the official code


def init_vvt_weights(module):
    """Official initialisation: trunc-normal(0.02) Linear, unit LayerNorm, fan-out normal Conv2d."""
    init_transformer_weights(module)
    if isinstance(module, nn.Conv2d):
        fan_out = module.kernel_size[0] * module.kernel_size[1] * module.out_channels // module.groups
        nn.init.normal_(module.weight, 0.0, math.sqrt(2.0 / fan_out))
        if module.bias is not None:
            nn.init.zeros_(module.bias)


class VicinityAttention(nn.Module):
    """Vicinity Attention Block: Feature Reduction Attention + Feature Preserving Connection.

    ``q_proj``/``k_proj``/``v_proj`` project C channels to ``C / fr_ratio``; the
    linear vicinity attention (:func:`visattn_mm.ops.vicinity.vicinity_attention`)
    runs per head on ``C / (fr_ratio * heads)`` channels; ``out_proj`` maps back to C.
    The gate ``s = sigmoid(se_fc(mean over tokens of the input))`` then gives
    ``out + out * s``. Signed clamps follow ``out_proj`` and the gate, as in the
    official code.

    Args:
        dim (int): Channels C.
        num_heads (int): Attention heads.
        fr_ratio (int): Feature reduction ratio of q/k/v. Default: 2.
        se_ratio (int): Hidden-width reduction of the gate's ``se_fc`` MLP
            (official models: 1, i.e. ``Linear(C, C)`` twice, without bias). Default: 1.
        proj_drop (float): Dropout on the output. Default: 0.
        attn_impl (str): The attention's path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.
        bf16_products (bool): bf16 operands for the attention's matrix products of
            bf16 inputs, on every path (tensor cores, coarser gradients); False: fp32. Default: False.
    """

    def __init__(self, dim, num_heads, fr_ratio=2, se_ratio=1, proj_drop=0.0, attn_impl='auto', bf16_products=False):
        super().__init__()
        self.num_heads = num_heads
        self.attn_impl = attn_impl
        self.bf16_products = bf16_products
        reduced = dim // fr_ratio
        self.q_proj = nn.Linear(dim, reduced)
        self.k_proj = nn.Linear(dim, reduced)
        self.v_proj = nn.Linear(dim, reduced)
        self.out_proj = nn.Linear(reduced, dim)
        # Official key names se_fc.0 / se_fc.2 (ReLU and Sigmoid carry no weights).
        self.se_fc = nn.Sequential(
            nn.Linear(dim, dim // se_ratio, bias=False),
            nn.ReLU(),
            nn.Linear(dim // se_ratio, dim, bias=False),
            nn.Sigmoid(),
        )
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, hw):
        """x: (B, H*W, C) (the block's normalised input); hw: (H, W)."""
        b, n, _ = x.shape
        gate = self.se_fc(x.mean(dim=1))
        # The three projections as one product (weights concatenated, checkpoint keys unchanged):
        # x is read, cast and kept for backward once, and backward runs one product for x's gradient.
        projections = (self.q_proj, self.k_proj, self.v_proj)
        qkv = F.linear(x, torch.cat([p.weight for p in projections]), torch.cat([p.bias for p in projections]))
        # Unbound along the (B, N, 3, heads, d) layout, so that backward stacks the three gradients
        # straight into the product's layout (one copy).
        q, k, v = (t.transpose(1, 2) for t in qkv.reshape(b, n, 3, self.num_heads, -1).unbind(2))
        out = vicinity_attention(q, k, v, *hw, impl=self.attn_impl, bf16_products=self.bf16_products)
        out = lean_signed_clamp(self.out_proj(out.transpose(1, 2).reshape(b, n, -1)))
        return self.proj_drop(preserve_features(out, gate))


class DWConv(nn.Module):
    """3x3 depthwise convolution applied to tokens laid out as an ``H x W`` map."""

    def __init__(self, dim):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 3, 1, 1, groups=dim)

    def forward(self, x, hw):
        b, n, c = x.shape
        x = self.dwconv(x.transpose(1, 2).reshape(b, c, *hw))
        return x.flatten(2).transpose(1, 2)


class _DepthwiseConvGeluLinear(torch.autograd.Function):
    """``linear(gelu(conv2d(x, conv_weight, conv_bias)), weight, bias)``: the 3x3 depthwise
    convolution (padding 1) of the ``(B, hidden, H, W)`` map ``x``, the GELU on its ``(B, H*W, hidden)``
    tokens and ``fc2``, keeping only ``x`` (and the weights) for backward.

    Autograd would keep three ``hidden``-wide tensors per block: the convolution's input and
    output (the GELU's input) and the GELU's output (``fc2``'s input). Backward here recomputes
    the convolution and the GELU from ``x`` (one depthwise pass and one elementwise pass) and
    then runs the products autograd would. The forward computes exactly what the modules do.
    All tensors share one dtype (the caller casts, as autocast would).
    """

    @staticmethod
    def _gelu_input(x, conv_weight, conv_bias):
        # The GELU runs on the tokens' (transposed) view, as in DWConv + GELU: its CPU kernel
        # rounds differently on a contiguous map.
        return F.conv2d(x, conv_weight, conv_bias, padding=1, groups=x.shape[1]).flatten(2).transpose(1, 2)

    @staticmethod
    def forward(ctx, x, conv_weight, conv_bias, weight, bias):
        ctx.save_for_backward(x, conv_weight, conv_bias, weight)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(F.gelu(_DepthwiseConvGeluLinear._gelu_input(x, conv_weight, conv_bias)), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, conv_weight, conv_bias, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad  # x, conv weight, conv bias, weight, bias
        with torch.autocast(x.device.type, enabled=False):
            gelu_input = _DepthwiseConvGeluLinear._gelu_input(x, conv_weight, conv_bias)
            through_conv = any(needs[:3])
            grad_hidden, grad_weight, grad_bias = gelu_linear_grads(
                grad, gelu_input, weight, (through_conv, *needs[3:])
            )
            grad_conv = (None, None, None)
            if through_conv:
                grad_conv = torch.ops.aten.convolution_backward(
                    grad_hidden.transpose(1, 2).reshape(x.shape),
                    x,
                    conv_weight,
                    [conv_weight.shape[0]],
                    [1, 1],
                    [1, 1],
                    [1, 1],
                    False,
                    [0, 0],
                    x.shape[1],
                    list(needs[:3]),
                )
        return (*grad_conv, grad_weight, grad_bias)


class _FusedConvGeluLinear(torch.autograd.Function):
    """``linear(depthwise_conv_gelu(x, impl='triton'), weight, bias)`` on tokens ``x``, keeping only ``x`` (and the
    weights) of the hidden-wide tensors for backward, as :class:`_DepthwiseConvGeluLinear` does on the torch path:
    backward runs the forward kernel again for ``fc2``'s weight gradient, then the two backward kernels. All
    tensors share one dtype (the caller casts, as autocast would).
    """

    @staticmethod
    def forward(ctx, x, conv_weight, conv_bias, weight, bias, height, width):
        ctx.save_for_backward(x, conv_weight, conv_bias, weight)
        ctx.hw = (height, width)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(depthwise_conv_gelu(x, height, width, conv_weight, conv_bias, 'triton'), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, conv_weight, conv_bias, weight = ctx.saved_tensors
        grad = grad.contiguous()  # once: a strided gradient would be copied by each of the two products
        with torch.autocast(x.device.type, enabled=False):
            grad_weight = summed_over_tokens(grad, depthwise_conv_gelu(x, *ctx.hw, conv_weight, conv_bias, 'triton'))
            grad_conv = depthwise_conv_gelu_backward(grad @ weight, x, *ctx.hw, conv_weight, conv_bias, 'triton')
        return (*grad_conv, grad_weight, grad.sum(tuple(range(grad.dim() - 1))), None, None)


class ConvMlp(nn.Module):
    """PVTv2 conv-FFN: fc1 -> 3x3 depthwise conv -> GELU -> dropout -> fc2 -> dropout.

    In training (without dropout inside) the convolution, GELU and ``fc2`` run as one autograd
    function that keeps only the convolution's input of the hidden-wide tensors
    (:class:`_DepthwiseConvGeluLinear`; :class:`_FusedConvGeluLinear` with ``fused_conv_gelu``).

    Args:
        dim (int): Channels in and out.
        hidden_dim (int): Hidden channels.
        drop (float): Dropout after the GELU and after ``fc2``. Default: 0.
        fused_conv_gelu (bool): Run the convolution and the GELU as one Triton kernel forward and two
            backward (:mod:`visattn_mm.ops.conv_gelu`; CUDA tensors, or Triton's interpreter). Default: False.
    """

    def __init__(self, dim, hidden_dim, drop=0.0, fused_conv_gelu=False):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.dwconv = DWConv(hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)
        self.fused_conv_gelu = fused_conv_gelu

    def forward(self, x, hw):
        x = self.fc1(x)
        conv = self.dwconv.dwconv
        if self.fused_conv_gelu:
            dtype = autocast_dtype(x)
            x, conv_weight, conv_bias = x.to(dtype), conv.weight.to(dtype), conv.bias.to(dtype)
            if keeps_gelu_input_only(self):
                fc2 = (self.fc2.weight.to(dtype), self.fc2.bias.to(dtype))
                return _FusedConvGeluLinear.apply(x, conv_weight, conv_bias, *fc2, *hw)
            x = self.drop(depthwise_conv_gelu(x, *hw, conv_weight, conv_bias, 'triton'))
            return self.drop(self.fc2(x))
        if conv.bias is None or not keeps_gelu_input_only(self):
            x = self.drop(self.act(self.dwconv(x, hw)))
            return self.drop(self.fc2(x))
        b, n, c = x.shape
        dtype = autocast_dtype(x)
        return _DepthwiseConvGeluLinear.apply(
            x.transpose(1, 2).reshape(b, c, *hw).to(dtype),
            *(t.to(dtype) for t in (conv.weight, conv.bias, self.fc2.weight, self.fc2.bias)),
        )


class VVTBlock(nn.Module):
    """Pre-LN block: x + attn(norm1(x)), then x + mlp(norm2(x)); LayerNorm eps 1e-6.

    Args:
        dim (int): Channels.
        num_heads (int): Attention heads.
        mlp_ratio (float): MLP hidden width / dim.
        drop (float): Dropout after the attention and in the MLP. Default: 0.
        drop_path (float): Stochastic depth of this block. Default: 0.
        fused_conv_gelu (bool): See :class:`ConvMlp`. Default: False.
        **attention: The rest of :class:`VicinityAttention`'s arguments (``fr_ratio``,
            ``se_ratio``, ``attn_impl``, ``bf16_products``).
    """

    def __init__(self, dim, num_heads, mlp_ratio, drop=0.0, drop_path=0.0, fused_conv_gelu=False, **attention):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = VicinityAttention(dim, num_heads, proj_drop=drop, **attention)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = ConvMlp(dim, int(dim * mlp_ratio), drop, fused_conv_gelu)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x, hw):
        x = x + self.drop_path(self.attn(self.norm1(x), hw))
        return x + self.drop_path(self.mlp(self.norm2(x), hw))


NUMBERED_LAYOUT = dict(patch_embed='stages.{i}.patch_embed', block='stages.{i}.blocks', norm='stages.{i}.norm')


def vvt_checkpoint_filter(state_dict, target_keys, report):
    """Prepare an official VVT (or our) state_dict for the dense backbone.

    The official names (``patch_embed{n}``, ``block{n}.{j}``, ``norm{n}``) are renamed
    to ours (``stages.{n-1}.patch_embed``, ``.blocks.{j}``, ``.norm``), as is a
    checkpoint of ours saved with them; the values are unchanged. Dropped, with the
    reason in the report: the classification ``head``, and the tensors of stages this
    backbone does not build (stages after the last ``out_indices``).
    """
    state_dict = dict(state_dict)
    rename_numbered_stage_keys(state_dict, NUMBERED_LAYOUT, report=report)
    if 'stages.0.patch_embed.proj.weight' in state_dict and 'stages.0.blocks.0.attn.q_proj.weight' in state_dict:
        report.layout = 'vvt_official' if 'head.weight' in state_dict else 'vvt'
    return drop_head_and_unbuilt_stages(state_dict, target_keys, report)


class VVT(DenseBackbone):
    """Vicinity Vision Transformer backbone.

    Args:
        arch (str | dict): ``'tiny'``, ``'small'``, ``'medium'``, ``'large'`` (or
            ``'t'``/``'s'``/``'m'``/``'l'``), or a dict with ``depths``,
            ``embed_dims`` and ``num_heads`` (one entry per stage) and optionally
            ``mlp_ratios`` (default 4 per stage). Default: 'small'.
        in_channels (int): Input image channels. Default: 3.
        fr_ratio (int): Feature reduction ratio of the attention's q/k/v
            (official models: 2). ``embed_dims[i]`` must be divisible by
            ``num_heads[i] * fr_ratio``. Default: 2.
        se_ratio (int): Hidden-width reduction of the Feature Preserving
            Connection's gate (official models: 1). Default: 1.
        drop_rate (float): Dropout after the attention output and in the MLP. Default: 0.
        drop_path_rate (float): Stochastic depth, rising linearly from 0 over all
            blocks to this value. Default: 0.1.
        attn_impl (str): The attention's path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.
        bf16_products (bool): Run the attention's matrix products (torch and Triton paths) on bf16
            operands when the inputs are bf16 (bf16 autocast): tensor cores, coarser gradients,
            opt-in. False: fp32 products. Default: False.
        fused_conv_gelu (bool): Run each conv-FFN's depthwise convolution and GELU as Triton kernels
            (:mod:`visattn_mm.ops.conv_gelu`: one forward, two backward, about half the passes over the
            hidden-wide tensors of the torch path), on CUDA tensors. Opt-in: no GPU has timed it yet.
            Default: False.
        **kwargs: The standard dense-backbone arguments (``out_indices``, ``frozen_stages``,
            ``norm_eval``, ``with_cp``, ``compile_blocks``, ``cuda_graphs``, ``pretrained``, ``init_cfg``), see
            :class:`~visattn_mm.models.base.DenseBackbone`. The outputs are the stages in
            ``out_indices``, each after that stage's LayerNorm ``stages.{i}.norm``; VVT has
            only LayerNorms, so ``norm_eval`` only affects BatchNorms added by subclasses.
            ``init_cfg`` loads official VVT checkpoints (``model`` container or bare) as they are.
    """

    arch_zoo = ARCH_ZOO
    arch_defaults = dict(mlp_ratios=DEFAULT_MLP_RATIO)
    attention_ops = (VICINITY,)
    crop_pct = 0.9  # PVT's evaluation crop
    numbered_layout = NUMBERED_LAYOUT
    checkpoint_filter = staticmethod(vvt_checkpoint_filter)

    def __init__(
        self,
        arch='small',
        in_channels=3,
        fr_ratio=2,
        se_ratio=1,
        drop_rate=0.0,
        drop_path_rate=0.1,
        attn_impl='auto',
        bf16_products=False,
        fused_conv_gelu=False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_attn_impl(attn_impl, 'VVT', self.attention_ops)
        for name, value in (('bf16_products', bf16_products), ('fused_conv_gelu', fused_conv_gelu)):
            if not isinstance(value, bool):
                raise ValueError(f'VVT: {name}={value!r} must be True or False')
        spec = self.resolve_arch(arch)
        depths, dims, heads, mlp_ratios = spec['depths'], spec['embed_dims'], spec['num_heads'], spec['mlp_ratios']
        check_int(fr_ratio, 'fr_ratio', 'VVT')
        check_int(se_ratio, 'se_ratio', 'VVT')
        for i, (d, h) in enumerate(zip(dims, heads)):
            if d % (h * fr_ratio):
                raise ValueError(
                    f'VVT: embed_dims[{i}]={d} is not divisible by num_heads[{i}]={h} '
                    f'x fr_ratio={fr_ratio} (each head needs whole reduced channels)'
                )
            if d % se_ratio:
                raise ValueError(f'VVT: embed_dims[{i}]={d} is not divisible by se_ratio={se_ratio}')
        drop_paths = self.init_stages(in_channels, depths, dims, drop_path_rate)

        attention = dict(fr_ratio=fr_ratio, se_ratio=se_ratio, attn_impl=attn_impl, bf16_products=bf16_products)

        def make_stage(i, in_dim):
            kernel, stride = (7, 4) if i == 0 else (3, 2)
            blocks = [
                VVTBlock(dims[i], heads[i], mlp_ratios[i], drop_rate, drop_path, fused_conv_gelu, **attention)
                for drop_path in drop_paths[i]
            ]
            embed = OverlapPatchEmbed(in_dim, dims[i], kernel, stride, eps=EMBED_LN_EPS)
            return Stage(embed, blocks, nn.LayerNorm(dims[i], eps=LN_EPS))

        self.build_stages(make_stage, init_vvt_weights)
