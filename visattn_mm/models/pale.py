"""Pale Transformer backbone for dense prediction.

Paper: "Pale Transformer: A General Vision Transformer Backbone with Pale-Shaped
Attention" (Wu et al., AAAI 2022). No official code or weights were ever released;
this implementation follows the paper (method section, Table 1) and the CvT/CSWin
conventions it cites where it is silent. Four stages ``stages.{i}``, each:

  * ``patch_embed``: overlapping conv patch merging -- 7x7 stride 4 (stage 1) or
    3x3 stride 2 (stages 2-4), channels ``C_{i-1} -> C_i`` -- then a LayerNorm
    (CvT's ``ConvEmbed`` and CSWin's stem / ``Merge_Block`` both normalise there).
    Padding ``k // 2`` (3, then 1), so every output side is ``ceil(side / stride)``
    for any input down to 1x1. (CvT/CSWin pad the 7x7 stem by 2: identical sizes
    when the input side is a multiple of 4, e.g. 56 at 224, but they drop the last
    rows otherwise and fail below 3 pixels.)
  * ``blocks.{j}``: ``X = X + CPE(X)`` (3x3 depthwise conv with bias),
    ``X = X + DropPath(PS-Attn(LN(X)))``, ``X = X + DropPath(MLP(LN(X)))``
    (GELU MLP, ratio 4).
and an output LayerNorm ``norm{i}`` per stage of ``out_indices`` (mmdet Swin
convention; the next stage's patch merging reads the un-normalised stage output).
The classification form therefore has one final norm (``norm3``) before the
average pooling, as CSWin. Checkpoints saved with the earlier numbered names
(``patch_embed{n}``, ``block{n}``, ``norm{n}``, 1-based) load renamed.

PS-Attention (parallel): q, k and v each come from a separable conv -- 3x3
depthwise -> BatchNorm -> 1x1 pointwise (with bias), CvT's
``conv_proj`` + ``proj_q/k/v`` -- computed on the unpadded map. The BatchNorm is
what the parameter counts call for: with it (and a depthwise bias) the
classifiers have 21.77M / 48.33M / 85.36M parameters, i.e. the unofficial port's
21.8M / 48.3M / 85.4M; without it 21.72M / 48.26M / 85.26M. Then the first half of
the heads (channels) attends within row groups, the second half within column
groups (:mod:`visattn_mm.ops.pale`); the halves are concatenated and projected by
``proj`` (Linear). LayerNorm eps 1e-5 throughout (PyTorch default, as CvT/CSWin).

The three separable convs keep their own modules and checkpoint keys (``attn.q.dw.weight``, ...)
but run as one of each layer over ``3C`` channels (:func:`separable_convs_as_one`): one
depthwise conv, one BatchNorm and one pointwise conv in three groups, with their weights joined
and cast once. Run one by one they take about three times the launches, and under autocast
each of their inputs and weights is cast on its own.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import DropPath

from ..ops.pale import pale_attention
from ..ops.specs import PALE
from .base import DenseBackbone, Stage, drop_head_and_unbuilt_stages, rename_numbered_stage_keys, with_aliases
from .layers import Mlp, OverlapPatchEmbed, autocast_dtype, check_attn_impl, check_int, init_transformer_weights

ARCH_ZOO = with_aliases(
    {
        'tiny': dict(depths=(2, 2, 16, 2), embed_dims=(64, 128, 256, 512), num_heads=(2, 4, 8, 16)),
        'small': dict(depths=(2, 2, 16, 2), embed_dims=(96, 192, 384, 768), num_heads=(2, 4, 8, 16)),
        'base': dict(depths=(2, 2, 16, 2), embed_dims=(128, 256, 512, 1024), num_heads=(4, 8, 16, 32)),
    }
)

DEFAULT_PALE_SIZE = 7  # per stage, for arch dicts without ``pale_sizes`` (paper: 7 everywhere)
DEFAULT_MLP_RATIO = 4  # per stage, for arch dicts without ``mlp_ratios``
LN_EPS = 1e-5


class SeparableConv(nn.Module):
    """3x3 depthwise conv -> BatchNorm -> 1x1 pointwise conv (CvT's q/k/v projection).

    Args:
        dim (int): Channels in and out.
        bias (bool): Bias of the pointwise conv. Default: True.
    """

    def __init__(self, dim, bias=True):
        super().__init__()
        # The depthwise bias is redundant before BatchNorm (CvT has none); it is kept
        # because the unofficial port's counts (21.8M / 48.3M / 85.4M) include it.
        self.dw = nn.Conv2d(dim, dim, 3, 1, 1, groups=dim)
        self.bn = nn.BatchNorm2d(dim)
        self.pw = nn.Conv2d(dim, dim, 1, bias=bias)

    def forward(self, x):
        return self.pw(self.bn(self.dw(x)))


def _run_as_one(convs):
    """Whether :func:`separable_convs_as_one` computes what ``convs`` compute one by one: their
    BatchNorms are plain ``nn.BatchNorm2d`` alike in mode and settings (not SyncBatchNorm, which
    mmengine's ``sync_bn`` swaps in and whose statistics span processes), and their pointwise
    convs all have a bias or none."""
    settings = {(c.bn.training, c.bn.momentum, c.bn.eps, c.bn.affine, c.bn.track_running_stats) for c in convs}
    plain = all(type(c.bn) is nn.BatchNorm2d for c in convs)
    return plain and len(settings) == 1 and len({c.pw.bias is None for c in convs}) == 1


def _joined(tensors):
    """The tensors flattened and concatenated: one launch, one autograd node."""
    return torch.cat([t.reshape(-1) for t in tensors])


def _split_as(flat, groups):
    """``flat`` split back into one tensor per group of like tensors, each group concatenated along
    dim 0 (``groups``: lists of tensors whose shapes are wanted)."""
    parts = flat.split([sum(t.numel() for t in group) for group in groups])
    return [part.view(-1, *group[0].shape[1:]) for part, group in zip(parts, groups)]


def separable_convs_as_one(tokens, hw, convs, scales):
    """``[conv(x) * scale for conv, scale in zip(convs, scales)]`` as one depthwise conv, one BatchNorm
    and the pointwise convs as products that write their gradients into one tensor.

    The input is repeated once per conv along the channels, so that the depthwise conv and the
    BatchNorm work on ``n * C`` channels in conv-major order with the convs' own weights concatenated.
    All the convs' trainable tensors are concatenated in one op and the conv weights cast once to the
    autocast dtype; the input is cast once before it is repeated. BatchNorm's running statistics are
    joined for the call and copied back after a training step, as ``nn.BatchNorm2d`` updates them.
    The pointwise convs read their channels of the joined map in place (:class:`_PointwiseProducts`).

    Args:
        tokens (Tensor): ``(B, H*W, C)``, the convs' input as tokens.
        hw (tuple[int, int]): ``(H, W)``.
        convs (Sequence[SeparableConv]): The convs, alike (:func:`_run_as_one`).
        scales (Sequence[float]): A factor per conv's output (the attention's query scale), folded
            into its product.

    Returns:
        list[Tensor]: One ``(B, H*W, C)`` output per conv, as tokens.
    """
    b, n, channels = tokens.shape
    dws, bns, pws = [conv.dw for conv in convs], [conv.bn for conv in convs], [conv.pw for conv in convs]
    conv_groups = [[m.weight for m in dws], [m.bias for m in dws], [m.weight for m in pws]]
    if pws[0].bias is not None:
        conv_groups.append([m.bias for m in pws])
    norm_groups = [[bn.weight for bn in bns], [bn.bias for bn in bns]] if bns[0].affine else []
    conv_flat, norm_flat = _joined([t for group in conv_groups + norm_groups for t in group]).split(
        [sum(t.numel() for group in groups for t in group) for groups in (conv_groups, norm_groups)]
    )
    dtype = autocast_dtype(tokens)
    tokens, conv_flat = tokens.to(dtype), conv_flat.to(dtype)
    dw_weight, dw_bias, pw_weight, *pw_bias = _split_as(conv_flat, conv_groups)
    norm_weight, norm_bias = _split_as(norm_flat, norm_groups) if norm_groups else (None, None)

    x = tokens.repeat(1, 1, len(convs)).transpose(1, 2).reshape(b, len(convs) * channels, *hw)
    x = F.conv2d(x, dw_weight, dw_bias, padding=1, groups=len(convs) * channels)
    x = _batch_norm_as_one(x, bns, norm_weight, norm_bias)
    rows = x.permute(0, 2, 3, 1).reshape(b * n, len(convs) * channels)  # a view: the convs keep channels-last
    products = _PointwiseProducts.apply if torch.is_grad_enabled() else _pointwise_products
    outputs = products(rows, pw_weight.flatten(1), pw_bias[0] if pw_bias else None, tuple(scales))
    return [out.view(b, n, channels) for out in outputs]


def _pointwise_products(rows, weight, bias, scales):
    """``scale_j * (rows_j @ weight_j^T + bias_j)`` for the ``j``-th of ``len(scales)`` blocks of
    channels of ``rows``, each a product reading its columns in place."""
    outputs = []
    for cols, scale in zip(_channel_blocks(rows, len(scales)), scales):
        if bias is None:
            out = torch.mm(rows[:, cols], weight[cols].t())
            outputs.append(out.mul_(scale) if scale != 1 else out)
        else:
            outputs.append(torch.addmm(bias[cols], rows[:, cols], weight[cols].t(), beta=scale, alpha=scale))
    return tuple(outputs)


class _PointwiseProducts(torch.autograd.Function):
    """:func:`_pointwise_products` with a backward that writes the gradients of every block of
    channels into one tensor (autograd would join three: one more pass over the ``n * C``-wide
    map). All tensors share one dtype (the caller casts)."""

    @staticmethod
    def forward(ctx, rows, weight, bias, scales):
        ctx.save_for_backward(rows, weight)
        ctx.scales, ctx.has_bias = scales, bias is not None
        with torch.autocast(rows.device.type, enabled=False):
            return _pointwise_products(rows, weight, bias, scales)

    @staticmethod
    def backward(ctx, *grads):
        rows, weight = ctx.saved_tensors
        blocks = _channel_blocks(rows, len(ctx.scales))
        needs_rows, needs_weight, needs_bias, _ = ctx.needs_input_grad
        # An output that reached no loss has no gradient.
        grads = [rows.new_zeros(rows.shape[0], weight.shape[1]) if grad is None else grad for grad in grads]
        grad_rows = grad_weight = grad_bias = None
        with torch.autocast(rows.device.type, enabled=False):
            if needs_rows and torch.compiler.is_compiling():
                # Dynamo refuses `out=` into a strided view (a graph break); Inductor plans the buffer itself.
                grad_rows = torch.cat([torch.mm(g, weight[c]) * s for c, g, s in zip(blocks, grads, ctx.scales)], 1)
            elif needs_rows:
                grad_rows = rows.new_empty(rows.shape)
                for cols, grad, scale in zip(blocks, grads, ctx.scales):
                    part = grad_rows[:, cols]  # beta=0: its uninitialised values are not read
                    torch.addmm(part, grad, weight[cols], beta=0, alpha=scale, out=part)
            if needs_weight:
                grad_weight = weight.new_empty(weight.shape)
                for cols, grad, scale in zip(blocks, grads, ctx.scales):
                    part = grad_weight[cols]
                    torch.addmm(part, grad.t(), rows[:, cols], beta=0, alpha=scale, out=part)
            if needs_bias and ctx.has_bias:
                grad_bias = weight.new_empty(weight.shape[0])
                for cols, grad, scale in zip(blocks, grads, ctx.scales):
                    torch.sum(grad, 0, out=grad_bias[cols])
                    if scale != 1:
                        grad_bias[cols].mul_(scale)
        return grad_rows, grad_weight, grad_bias, None


def _channel_blocks(rows, count):
    """The ``count`` equal column slices of ``rows``."""
    width = rows.shape[1] // count
    return [slice(j * width, (j + 1) * width) for j in range(count)]


def _batch_norm_as_one(x, bns, weight, bias):
    """``nn.BatchNorm2d.forward`` of the ``bns`` (alike) over their channels concatenated in ``x``."""
    first = bns[0]
    batch_stats = first.training or not first.track_running_stats
    factor = 0.0 if first.momentum is None else first.momentum
    if first.training and first.track_running_stats:
        counters = [bn.num_batches_tracked for bn in bns]
        torch._foreach_add_(counters, 1)
        if first.momentum is None:  # a cumulative average, as nn.BatchNorm2d (which also reads the count)
            factor = 1.0 / float(first.num_batches_tracked)
    stats = []
    if first.track_running_stats:
        stats = [bn.running_mean for bn in bns] + [bn.running_var for bn in bns]
    joined = _joined(stats).chunk(2) if stats else (None, None)
    x = F.batch_norm(x, *joined, weight, bias, batch_stats, factor, first.eps)
    if stats and batch_stats:
        torch._foreach_copy_(stats, [part for half in joined for part in half.chunk(len(bns))])
    return x


class PaleAttention(nn.Module):
    """Parallel pale-shaped self-attention.

    Args:
        dim (int): Channels C; divisible by ``num_heads``.
        num_heads (int): Heads; even, half of them per branch (row / column).
        pale_size (int | tuple[int, int]): ``s`` or ``(s_r, s_c)``, interlaced rows /
            columns per group. Default: 7.
        qkv_bias (bool): Bias of the pointwise q/k/v convs. Default: True.
        attn_drop (float): Dropout on the attention probabilities. Default: 0.
        proj_drop (float): Dropout after ``proj``. Default: 0.
        attn_impl (str): The attention's path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.
    """

    def __init__(self, dim, num_heads, pale_size=7, qkv_bias=True, attn_drop=0.0, proj_drop=0.0, attn_impl='auto'):
        super().__init__()
        self.num_heads = num_heads
        self.pale_size = pale_size
        self.scale = (dim // num_heads) ** -0.5
        self.q = SeparableConv(dim, qkv_bias)
        self.k = SeparableConv(dim, qkv_bias)
        self.v = SeparableConv(dim, qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = attn_drop
        self.attn_impl = attn_impl
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, hw):
        """x: (B, H*W, C) (the block's normalised input); hw: (H, W)."""
        b, n, c = x.shape
        convs, scales = (self.q, self.k, self.v), (self.scale, 1.0, 1.0)
        if _run_as_one(convs):
            maps = separable_convs_as_one(x, hw, convs, scales)
        else:
            image = x.transpose(1, 2).reshape(b, c, *hw)
            maps = [conv(image).flatten(2).transpose(1, 2) for conv in convs]
            maps[0] = maps[0] * self.scale
        q, k, v = (m.reshape(b, n, self.num_heads, -1).transpose(1, 2) for m in maps)
        out = pale_attention(
            q,
            k,
            v,
            *hw,
            self.pale_size,
            dropout_p=self.attn_drop if self.training else 0.0,
            impl=self.attn_impl,
        )
        out = out.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(out))


class PaleBlock(nn.Module):
    """``x + cpe(x)``; ``x + attn(norm1(x))``; ``x + mlp(norm2(x))`` (drop path on the last two).

    Args:
        dim (int): Channels.
        num_heads (int): Attention heads (even).
        pale_size (int): Pale size of the attention.
        mlp_ratio (float): MLP hidden width / dim.
        qkv_bias (bool): Bias of the pointwise q/k/v convs.
        drop (float): Dropout after the attention projection and in the MLP.
        attn_drop (float): Dropout on the attention probabilities.
        drop_path (float): Stochastic depth of this block.
        attn_impl (str): Attention implementation, see :class:`PaleAttention`.
    """

    def __init__(
        self,
        dim,
        num_heads,
        pale_size,
        mlp_ratio,
        qkv_bias=True,
        drop=0.0,
        attn_drop=0.0,
        drop_path=0.0,
        attn_impl='auto',
    ):
        super().__init__()
        self.cpe = nn.Conv2d(dim, dim, 3, 1, 1, groups=dim)
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = PaleAttention(dim, num_heads, pale_size, qkv_bias, attn_drop, drop, attn_impl)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x, hw):
        b, n, c = x.shape
        x = x + self.cpe(x.transpose(1, 2).reshape(b, c, *hw)).flatten(2).transpose(1, 2)
        x = x + self.drop_path(self.attn(self.norm1(x), hw))
        return x + self.drop_path(self.mlp(self.norm2(x)))


NUMBERED_LAYOUT = dict(patch_embed='stages.{i}.patch_embed', block='stages.{i}.blocks', norm='norm{i}')


def pale_checkpoint_filter(state_dict, target_keys, report):
    """Prepare a Pale state_dict (ours, e.g. from :class:`~visattn_mm.models.Classifier`) for the dense backbone.

    Keys of the earlier numbered layout are renamed (``NUMBERED_LAYOUT``). Dropped,
    with the reason in the report: the classification ``head``, tensors of stages this
    backbone does not build, and output norms ``norm{i}`` it does not build. A
    classification checkpoint has only the last stage's output norm; the dense
    backbone's other ``norm{i}`` keep their fresh initialisation and are reported as
    such (not as missing).
    """
    state_dict = dict(state_dict)
    rename_numbered_stage_keys(state_dict, NUMBERED_LAYOUT, report=report)
    if 'stages.0.patch_embed.proj.weight' in state_dict and 'stages.0.blocks.0.attn.q.dw.weight' in state_dict:
        report.layout = 'pale'
    out = drop_head_and_unbuilt_stages(
        state_dict,
        target_keys,
        report,
        other_reason=lambda key: (
            'output norm not built (stage not in out_indices)'
            if key.startswith('norm') and key not in target_keys
            else None
        ),
    )
    if report.layout == 'pale':
        for key in sorted(target_keys):
            if key.startswith('norm') and key not in state_dict:
                report.fresh[key] = 'output norm not in the checkpoint (a classifier has only the last one)'
    return out


class PaleTransformer(DenseBackbone):
    """Pale Transformer backbone.

    Args:
        arch (str | dict): ``'tiny'``, ``'small'``, ``'base'`` (or ``'t'``/``'s'``/``'b'``),
            or a dict with ``depths``, ``embed_dims`` and ``num_heads`` (one entry per
            stage) and optionally ``pale_sizes`` (default 7) and ``mlp_ratios``
            (default 4). ``embed_dims[i]`` must be divisible by ``num_heads[i]``, and
            ``num_heads[i]`` must be even (half the heads per branch). Default: 'tiny'.
        in_channels (int): Input image channels. Default: 3.
        qkv_bias (bool): Bias of the pointwise q/k/v convs. Default: True.
        drop_rate (float): Dropout after the attention projection and in the MLP. Default: 0.
        attn_drop_rate (float): Dropout on the attention probabilities. Default: 0.
        drop_path_rate (float): Stochastic depth, rising linearly from 0 over all
            blocks to this value. Default: 0.1.
        attn_impl (str): The attention's path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.
        **kwargs: The standard dense-backbone arguments (``out_indices``, ``frozen_stages``,
            ``norm_eval``, ``with_cp``, ``compile_blocks``, ``cuda_graphs``, ``pretrained``, ``init_cfg``), see
            :class:`~visattn_mm.models.base.DenseBackbone`. The outputs are the stages in
            ``out_indices``, each after its LayerNorm ``norm{i}`` (built only for these stages).
            ``norm_eval`` keeps the BatchNorms of the q/k/v projections in eval mode:
            training-mode BatchNorm needs more than one value per channel, i.e.
            ``B * H/32 * W/32 > 1`` in stage 4; with ``norm_eval=True`` (or in eval mode) any
            size works. ``init_cfg`` loads classification checkpoints of
            :class:`~visattn_mm.models.Classifier` (and mmdet/mmseg checkpoints of this
            backbone) as they are.
    """

    arch_zoo = ARCH_ZOO
    arch_defaults = dict(pale_sizes=DEFAULT_PALE_SIZE, mlp_ratios=DEFAULT_MLP_RATIO)
    attention_ops = (PALE,)
    crop_pct = 0.875  # the paper resizes to 256 and crops 224
    numbered_layout = NUMBERED_LAYOUT
    checkpoint_filter = staticmethod(pale_checkpoint_filter)

    def __init__(
        self,
        arch='tiny',
        in_channels=3,
        qkv_bias=True,
        drop_rate=0.0,
        attn_drop_rate=0.0,
        drop_path_rate=0.1,
        attn_impl='auto',
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_attn_impl(attn_impl, 'PaleTransformer', self.attention_ops)
        spec = self.resolve_arch(arch)
        depths, dims, heads = spec['depths'], spec['embed_dims'], spec['num_heads']
        pale_sizes, mlp_ratios = spec['pale_sizes'], spec['mlp_ratios']
        for i, (h, s) in enumerate(zip(heads, pale_sizes)):
            check_int(s, f'pale_sizes[{i}]', 'PaleTransformer')
            if h % 2:
                raise ValueError(
                    f'PaleTransformer: num_heads[{i}]={h!r} must be even (half of the heads '
                    f'attend within row groups, half within column groups)'
                )
        drop_paths = self.init_stages(in_channels, depths, dims, drop_path_rate)
        self.pale_sizes = tuple(pale_sizes[: self.num_stages])

        def make_stage(i, in_dim):
            kernel, stride = (7, 4) if i == 0 else (3, 2)
            blocks = [
                PaleBlock(
                    dims[i],
                    heads[i],
                    pale_sizes[i],
                    mlp_ratios[i],
                    qkv_bias,
                    drop_rate,
                    attn_drop_rate,
                    drop_path,
                    attn_impl,
                )
                for drop_path in drop_paths[i]
            ]
            return Stage(OverlapPatchEmbed(in_dim, dims[i], kernel, stride, eps=LN_EPS), blocks)

        # Convs and BatchNorms keep PyTorch's default init.
        self.build_stages(make_stage, init_transformer_weights, lambda dim: nn.LayerNorm(dim, eps=LN_EPS))

    def check_input(self, x):
        """Training BatchNorm (in the q/k/v convs) needs more than one value per channel.

        The last built stage has ``B * ceil(H / s) * ceil(W / s)`` values, ``s`` its stride.
        """
        stride = 4 * 2 ** (self.num_stages - 1)
        values = x.shape[0] * -(-x.shape[2] // stride) * -(-x.shape[3] // stride)
        training_bn = any(m.training for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm))
        if training_bn and values < 2:
            raise ValueError(
                f'PaleTransformer in training mode needs more than 1 value per channel at stride {stride} '
                f'for its BatchNorms; a batch of {x.shape[0]} image(s) of {tuple(x.shape[2:])} gives 1. Use '
                f'a batch of 2 or more, an image larger than {stride} pixels on one side, or norm_eval=True.'
            )
