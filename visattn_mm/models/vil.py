"""Multi-Scale Vision Longformer (ViL) backbone for dense prediction.

Paper: "Multi-Scale Vision Longformer: A New Vision Transformer for High-Resolution
Image Encoding" (Zhang et al., ICCV 2021). Four stages; each stage is a patch
embedding (conv + LayerNorm) that prepends fresh learned global tokens, followed by
pre-LN blocks of sliding-chunk attention and an MLP. Global tokens are dropped at
the end of every stage; the local tokens of each stage are the multi-scale outputs
(strides 4, 8, 16, 32).

Stages may also use full attention with an RPB table sized for the pretraining
resolution (resized for other map sizes), which is how the official
classification models run stages 3-4 at 224x224, or Transformer-LS
long-short attention, which makes the skeleton ViL-LS (:class:`ViLLS`; see
``attn_types``).
"""

import math
import re

import torch
import torch.nn as nn
from timm.layers import DropPath, trunc_normal_

from ..ops.indexing import check_modes
from ..ops.rel_pos import long_short_rpb_table_size, resize_1d_table, resize_rpb_table
from ..ops.specs import LONG_SHORT, SLIDING_CHUNK
from .base import DenseBackbone, Stage, drop_head_and_unbuilt_stages, with_aliases
from .layers import (
    Mlp,
    check_attn_impl,
    check_int,
    check_mlp_ratio,
    check_stage_lengths,
    init_transformer_weights,
    pad_to_multiple,
)
from .vil_attention import FullAttention, LongShortAttention, SlidingChunkAttention, with_contiguous_grad

ARCH_ZOO = with_aliases(
    {
        'tiny': dict(depths=(1, 1, 9, 1), embed_dims=(48, 96, 192, 384), num_heads=(1, 3, 3, 6)),
        'small': dict(depths=(1, 2, 8, 1), embed_dims=(96, 192, 384, 768), num_heads=(3, 3, 6, 12)),
        'medium': dict(depths=(1, 4, 16, 1), embed_dims=(96, 192, 384, 768), num_heads=(3, 3, 6, 12)),
        'base': dict(depths=(1, 8, 24, 1), embed_dims=(96, 192, 384, 768), num_heads=(3, 3, 6, 12)),
    }
)

# ViL-LS (Transformer-LS paper Table 5: Medium and Base; Tiny and Small are the ViL
# depths with long-short attention). Same depths, dims and heads as ViL.
LS_ARCH_ZOO = dict(ARCH_ZOO)

PATCH_SIZES = (4, 2, 2, 2)
NUM_GLOBAL_TOKENS = (1, 1, 1, 0)
ATTN_TYPES = ('sliding_chunk', 'full', 'long_short')
LS_ATTN_TYPES = ('long_short', 'long_short', 'sliding_chunk', 'sliding_chunk')
LN_EPS = 1e-6  # every LayerNorm of the official ViL code


# Official checkpoints -> ours (timm style: plain functions the backbones declare).


def adapt_position_tensor(name, value, target_shape):
    """Fit a checkpoint's position table or global-token tensor to another size.

    * ``local_relative_position_bias_table``: bilinear resize of the square
      offset grid (e.g. a 13x13 full-attention table of a 7x7 map -> 27x27).
      Long-short window tables (same name, no grid) never get here with another
      size: :meth:`ViL.resize_checkpoint_tensor` refuses them first.
    * ``x_pos_embed`` / ``y_pos_embed``: linear resize of the 1-D APE tables.
    * ``cls_token``, ``cls_pos_embed``, ``g2l_*``/``g2g_*`` biases: another number
      of global tokens; tokens are repeated cyclically or cut.

    Returns:
        Tensor | None: The adapted tensor, or None if ``value`` cannot fit.
    """
    target_shape = tuple(target_shape)
    if name == 'local_relative_position_bias_table' and value.shape[1:] == target_shape[1:]:
        try:
            return resize_rpb_table(value, target_shape[0])
        except ValueError:
            return None
    if name in ('x_pos_embed', 'y_pos_embed') and value.shape[::2] == target_shape[::2]:
        return resize_1d_table(value, target_shape[1])
    if name in ('cls_token', 'cls_pos_embed') and value.shape[::2] == target_shape[::2]:
        return value[:, torch.arange(target_shape[1]) % value.shape[1]]
    if name == 'g2l_relative_position_bias' and value.shape[:2] == target_shape[:2]:
        return value[..., torch.arange(target_shape[2]) % value.shape[2]]
    if name == 'g2g_relative_position_bias' and value.shape[0] == target_shape[0]:
        idx = torch.arange(target_shape[1]) % value.shape[1]
        return value[:, idx][:, :, idx]
    return None


_OFFICIAL_KEY = re.compile(r'layer(\d+)\.(\d+)\.(.+)')


def vil_checkpoint_filter(state_dict, target_keys, report):
    """Convert an official ViL / ViL-LS checkpoint (``layerN.M.*`` keys) to our layout.

    Official stages are ``layer1..layer4`` (index 0 = patch embedding, ``2j+1`` =
    attention block j, ``2j+2`` = MLP block j). Full-attention ``qkv`` is split into
    ``query`` (first C rows) and ``kv`` where our stage uses sliding-chunk attention;
    the ``*_global`` copies of shared weights are dropped after checking they equal
    their originals; index buffers, the classification head and the tensors of
    stages the model does not build are dropped; the final ``norm`` becomes the last
    stage's output norm when there is one. Our own
    layouts (dense, or the classifier's ``backbone.`` keys) keep their names; in all
    layouts a full-attention ``qkv`` is split where the target stage is sliding-chunk.
    Position tables of another size are resized later by the load pre-hook.
    """
    if 'layer1.0.proj.weight' in state_dict:
        state_dict = _convert_official_vil(state_dict, target_keys, report)
    out = _split_full_qkv(drop_head_and_unbuilt_stages(state_dict, target_keys, report), target_keys, report)
    for key in sorted(target_keys):  # a set: sorted, so that the report reads the same in every run
        if re.fullmatch(r'norm\d+\.(weight|bias)', key) and key not in out:
            report.fresh[key] = 'output norm; classification checkpoints have only the final one'
    return out


def _split_full_qkv(state_dict, target_keys, report):
    """Full-attention ``qkv`` (official or our classification layout) into ``query``/``kv``.

    Only where the target stage runs sliding-chunk attention (it has ``query``);
    ``query`` is the first C rows, ``kv`` the remaining 2C.
    """
    out = {}
    for key, value in state_dict.items():
        qkv = re.match(r'(.+\.attn\.)qkv\.(weight|bias)$', key)
        if qkv and f'{qkv.group(1)}query.{qkv.group(2)}' in target_keys:
            dim = value.shape[0] // 3
            for name, part_value in (('query', value[:dim]), ('kv', value[dim:])):
                new_key = f'{qkv.group(1)}{name}.{qkv.group(2)}'
                out[new_key] = part_value
                report.converted[new_key] = f'{key}[{"0:C" if name == "query" else "C:3C"}]'
        else:
            out[key] = value
    return out


def _convert_official_vil(state_dict, target_keys, report):
    report.layout = 'vil_official'
    stages = sorted({int(m.group(1)) for m in map(_OFFICIAL_KEY.match, state_dict) if m})
    out = {}
    for key, value in state_dict.items():
        match = _OFFICIAL_KEY.match(key)
        if key.startswith('head.'):
            report.dropped[key] = 'classification head'
            continue
        if key.startswith('norm.'):
            new = f'norm{stages[-1] - 1}.{key[len("norm.") :]}'
            if new in target_keys:
                out[new] = value
                report.converted[new] = key
            else:
                report.dropped[key] = 'final norm (no output norm on the last stage)'
            continue
        if not match:
            out[key] = value
            continue
        stage, index, rest = int(match.group(1)) - 1, int(match.group(2)), match.group(3)
        if index == 0:
            new = f'stages.{stage}.patch_embed.{rest}'
        else:
            block = f'stages.{stage}.blocks.{(index - 1) // 2}'
            part = rest.split('.', 1)
            if part[0] == 'norm':
                new = f'{block}.{"norm1" if index % 2 else "norm2"}.{part[1]}'
            else:
                new = f'{block}.{rest}'
        if new.endswith('relative_position_index'):
            report.dropped[key] = 'index buffer (recomputed)'
            continue
        shared = re.match(r'(.+\.attn\.)(query|kv|proj)_global\.(weight|bias)$', new)
        if shared:
            original = state_dict[key.replace('_global.', '.')] if key.replace('_global.', '.') in state_dict else None
            if original is not None and not torch.equal(original, value):
                report.dropped[key] = 'DIFFERS from the shared weight it should copy; ours shares one'
            else:
                report.dropped[key] = 'duplicate of a shared weight'
            continue
        out[new] = value  # renamed only: counts as loaded as-is
    return out


class ViLBlock(nn.Module):
    """Pre-LN transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim, attn, mlp_ratio=4.0, drop=0.0, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x, hw, *attn_args):
        """``attn_args`` go to the attention (a sliding-chunk layer's drawn shift mode)."""
        x = x + self.drop_path(self.attn(self.norm1(x), hw, *attn_args))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class ViLPatchEmbed(nn.Module):
    """Conv patch embedding + LayerNorm, then the stage's learned global tokens.

    Inputs whose sides are not multiples of the patch size are zero-padded at
    the bottom/right, so output sides are ``ceil(H / p)``.

    With absolute position embeddings (``ape_size`` set), 1-D row/column tables
    are linearly interpolated to the actual map size.
    """

    def __init__(self, in_channels, dim, patch_size, num_global, ape_size=None, drop=0.0):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, dim, kernel_size=patch_size, stride=patch_size)
        self.norm_embed = nn.LayerNorm(dim, eps=LN_EPS)
        self.num_global = num_global
        if num_global:
            self.cls_token = nn.Parameter(torch.zeros(1, num_global, dim))
            trunc_normal_(self.cls_token, std=0.02)
        self.use_ape = ape_size is not None
        if self.use_ape:
            rows, cols = ape_size
            # Official names: x_pos_embed runs along rows (first axis), y_pos_embed along columns.
            self.x_pos_embed = nn.Parameter(torch.zeros(1, rows, dim // 2))
            self.y_pos_embed = nn.Parameter(torch.zeros(1, cols, dim - dim // 2))
            self.cls_pos_embed = nn.Parameter(torch.zeros(1, num_global, dim))
            for p in (self.x_pos_embed, self.y_pos_embed, self.cls_pos_embed):
                trunc_normal_(p, std=0.02)
        self.pos_drop = nn.Dropout(drop)

    def forward(self, x):
        x = self.proj(pad_to_multiple(x, self.patch_size))
        b, _, h, w = x.shape
        x = self.norm_embed(x.flatten(2).transpose(1, 2))
        if self.use_ape:
            rows = resize_1d_table(self.x_pos_embed, h)[:, :, None].expand(-1, -1, w, -1)
            cols = resize_1d_table(self.y_pos_embed, w)[:, None].expand(-1, h, -1, -1)
            x = x + torch.cat([rows, cols], dim=-1).flatten(1, 2)
        if self.num_global:
            glob = self.cls_token
            if self.use_ape:
                glob = glob + self.cls_pos_embed
            x = torch.cat([with_contiguous_grad(glob).expand(b, -1, -1), x], dim=1)
        return self.pos_drop(x), (h, w)


class ViL(DenseBackbone):
    """Multi-Scale Vision Longformer backbone.

    Subclasses set ``arch_zoo`` to their own presets (see :class:`ViLLS`).

    Args:
        arch (str | dict): ``'tiny'``, ``'small'``, ``'medium'``, ``'base'`` (or
            ``'t'``/``'s'``/``'m'``/``'b'``), or a dict with ``depths``,
            ``embed_dims`` and ``num_heads`` (4 entries each) and optionally
            ``patch_sizes`` and ``num_global_tokens``.
        in_channels (int): Input image channels. Default: 3.
        window_size (int | Sequence[int]): Chunk size ``w`` per stage. Default: 7.
        num_global_tokens (Sequence[int], optional): Global tokens per stage.
            Default: the arch's, ``(1, 1, 1, 0)``.
        attn_types (str | Sequence[str]): ``'sliding_chunk'`` (any input size),
            ``'full'`` (RPB table sized for ``pretrain_img_size``, resized for other
            sizes; quadratic in the map size; the official classification layout of
            stages 3-4) or ``'long_short'`` (Transformer-LS,
            any input size; see :class:`ViLLS`), per stage. Default: all
            ``'sliding_chunk'``, the official detection layout.
        dp_rank (int | Sequence[int]): Dynamic-projection rank ``r`` of
            ``'long_short'`` stages, per stage. Default: 8.
        masking_mode (int): Sliding-chunk masking: 0 (hide neighbours outside the
            chunk grid), -1 (cyclic), 1 (exact ``2w+1`` window). Default: 0.
        shift_mode (int): Neighbour chunks used when random shift is off: 0 (all 8),
            -1 (own chunk only) or a fixed 1..8. Default: 0.
        random_shift (bool): Start with random-shift training on (usually left to
            :class:`RandomShiftHook`). Evaluation always uses ``shift_mode``.
        use_rpb (bool): Relative positional bias; False uses 1-D absolute position
            embeddings sized for ``pretrain_img_size``, interpolated at run time.
        pretrain_img_size (int | tuple[int, int]): Image size the position tables
            were trained for (APE and full attention). Default: 224.
        qkv_bias (bool): Bias in the query/key/value projections. Default: True.
        mlp_ratio (float): MLP hidden ratio. Default: 4.
        drop_rate (float): Dropout after the embedding, the MLP and ``proj``.
        attn_drop_rate (float): Dropout on attention probabilities.
        drop_path_rate (float): Stochastic depth, linear from 0 over all blocks.
            Default: 0.1.
        attn_impl (str): The sliding-chunk and long-short attentions' path: 'auto', 'fast', 'math' or
            'triton' (what each runs: :mod:`visattn_mm.ops.impl`); full attention has one. Default: 'auto'.
        **kwargs: The standard dense-backbone arguments (``out_indices``, ``frozen_stages``,
            ``norm_eval``, ``with_cp``, ``compile_blocks``, ``cuda_graphs``, ``pretrained``, ``init_cfg``), see
            :class:`~visattn_mm.models.base.DenseBackbone`. The outputs are the local tokens of
            the stages in ``out_indices``, each after its own LayerNorm ``norm{i}``; ViL has
            only LayerNorms, so ``norm_eval`` only affects BatchNorms added by subclasses.
    """

    arch_zoo = ARCH_ZOO
    arch_defaults = dict(patch_sizes=PATCH_SIZES, num_global_tokens=NUM_GLOBAL_TOKENS)
    attention_ops = (SLIDING_CHUNK,)
    crop_pct = 0.875  # DeiT's evaluation crop
    checkpoint_filter = staticmethod(vil_checkpoint_filter)
    derived_tensors = ('relative_position_index',)

    def __init__(
        self,
        arch='small',
        in_channels=3,
        window_size=7,
        num_global_tokens=None,
        attn_types='sliding_chunk',
        dp_rank=8,
        masking_mode=0,
        shift_mode=0,
        random_shift=False,
        use_rpb=True,
        pretrain_img_size=224,
        qkv_bias=True,
        mlp_ratio=4.0,
        drop_rate=0.0,
        attn_drop_rate=0.0,
        drop_path_rate=0.1,
        attn_impl='auto',
        **kwargs,
    ):
        name = type(self).__name__
        super().__init__(**kwargs)
        check_attn_impl(attn_impl, name, self.attention_ops)
        spec = self.resolve_arch(arch)
        depths, dims, heads, patch_sizes = spec['depths'], spec['embed_dims'], spec['num_heads'], spec['patch_sizes']
        num_stages = len(depths)
        if num_global_tokens is None:
            num_global_tokens = spec['num_global_tokens']
        elif not isinstance(num_global_tokens, (list, tuple)):  # e.g. -1: say that, not just the length
            check_int(num_global_tokens, 'num_global_tokens', name, minimum=0)
        check_stage_lengths(name, num_stages, num_global_tokens=num_global_tokens)
        windows = self._per_stage(window_size, num_stages, 'window_size')
        attn_types = self._per_stage(attn_types, num_stages, 'attn_types')
        dp_ranks = self._per_stage(dp_rank, num_stages, 'dp_rank')
        for i, t in enumerate(attn_types):
            if t not in ATTN_TYPES:
                raise ValueError(f'{name}: attn_types[{i}]={t!r}; allowed: {ATTN_TYPES}')
        for i, (w, r, p) in enumerate(zip(windows, dp_ranks, patch_sizes)):
            check_int(w, f'window_size[{i}]', name)
            check_int(r, f'dp_rank[{i}]', name)
            check_int(p, f'patch_sizes[{i}]', name)
        for i, g in enumerate(num_global_tokens):
            check_int(g, f'num_global_tokens[{i}]', name, minimum=0)
        for d in dims:
            check_mlp_ratio(mlp_ratio, 'mlp_ratio', name, d)
        try:
            check_modes(masking_mode, shift_mode, random_shift)
        except ValueError as err:
            raise ValueError(f'{name}: {err}') from None
        strides = [math.prod(patch_sizes[: i + 1]) for i in range(num_stages)]
        drop_paths = self.init_stages(in_channels, depths, dims, drop_path_rate, strides)
        self.num_global_tokens = tuple(num_global_tokens)
        img_h, img_w = (pretrain_img_size,) * 2 if isinstance(pretrain_img_size, int) else pretrain_img_size

        def make_stage(i, in_dim):
            table_size = (math.ceil(img_h / strides[i]), math.ceil(img_w / strides[i]))
            blocks = []
            for drop_path in drop_paths[i]:
                common = dict(
                    num_global=num_global_tokens[i],
                    qkv_bias=qkv_bias,
                    use_rpb=use_rpb,
                    attn_drop=attn_drop_rate,
                    proj_drop=drop_rate,
                )
                if attn_types[i] == 'full':
                    attn = FullAttention(dims[i], heads[i], rpb_size=table_size, **common)
                elif attn_types[i] == 'long_short':
                    attn = LongShortAttention(
                        dims[i], heads[i], window=windows[i], dp_rank=dp_ranks[i], attn_impl=attn_impl, **common
                    )
                else:
                    attn = SlidingChunkAttention(
                        dims[i],
                        heads[i],
                        window=windows[i],
                        masking_mode=masking_mode,
                        shift_mode=shift_mode,
                        random_shift=random_shift,
                        attn_impl=attn_impl,
                        **common,
                    )
                blocks.append(ViLBlock(dims[i], attn, mlp_ratio, drop_rate, drop_path))
            embed = ViLPatchEmbed(
                in_dim,
                dims[i],
                patch_sizes[i],
                num_global_tokens[i],
                ape_size=None if use_rpb else table_size,
                drop=drop_rate,
            )
            return Stage(embed, blocks)

        self.build_stages(make_stage, init_transformer_weights, lambda dim: nn.LayerNorm(dim, eps=LN_EPS))

    def resize_checkpoint_tensor(self, key, value, target_shape):
        """Position tables and global-token tensors of another size (:func:`adapt_position_tensor`).

        Raises:
            ValueError: For a long-short window RPB table with another number of rows:
                its index aliases offsets (see :mod:`visattn_mm.ops.long_short`), so it has
                no 2-D grid to resize; another row count means another window ``w``, and a
                resized table would silently mean something else.
        """
        module_name, name = key.rsplit('.', 1)
        module = self.get_submodule(module_name)
        if isinstance(module, LongShortAttention) and name == 'local_relative_position_bias_table':
            if value.shape[1:] != target_shape[1:]:
                return None  # another head count: an ordinary mismatch
            rows = value.shape[0]
            fits = [w for w in range(1, 65) if long_short_rpb_table_size(w) == rows]
            hint = (
                f'the checkpoint was trained with window_size={fits[0]}: build the model with it'
                if fits
                else 'no window size gives that many rows'
            )
            raise ValueError(
                f'{key}: the checkpoint\'s long-short window RPB table has {rows} rows, this model\'s '
                f'{target_shape[0]} (window_size={module.window}). These tables index offsets with aliasing and '
                f'cannot be resized; {hint}.'
            )
        return adapt_position_tensor(name, value, target_shape)

    @classmethod
    def _per_stage(cls, value, num_stages, name):
        values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * num_stages
        if len(values) != num_stages:
            raise ValueError(f'{cls.__name__}: {name} needs 1 or {num_stages} entries, got {value!r}')
        return values

    def run_block(self, block, tokens, hw):
        # The random-shift neighbour is drawn here, outside gradient checkpointing, so
        # that the recomputed forward pass uses the same keys.
        if isinstance(block.attn, SlidingChunkAttention):
            return super().run_block(block, tokens, hw, block.attn.resolve_shift_mode())
        return super().run_block(block, tokens, hw)

    def finish_stage(self, i, tokens):
        """Drop the stage's global tokens (the next stage prepends fresh ones)."""
        return tokens[:, self.num_global_tokens[i] :]

    def static_step_blocker(self):
        if any(getattr(module, 'random_shift', False) for module in self.modules()):
            return 'random shift draws a neighbour per block and step'
        return None


class ViLLS(ViL):
    """Transformer-LS backbone ("ViL-LS"): long-short attention in stages 1-2 of ViL.

    Paper: "Long-Short Transformer: Efficient Transformers for Language and Vision"
    (Zhu et al., NeurIPS 2021). The ViL skeleton (patch embeddings with global
    tokens, pre-LN blocks, outputs at strides 4-32) with :class:`LongShortAttention`
    (segment window of ``w + 2p`` keys per axis + dynamic projection of rank ``r`` +
    global tokens, DualLN) in stages 1-2.

    Dense-prediction layout: the released classification models run ViL full
    attention in stages 3-4, bound to the 14x14 / 7x7 maps of a 224 input. Here
    stages 3-4 run ViL sliding-chunk attention, so any input size works, and an
    official ViL-LS checkpoint loads exactly as ViL's own detection recipe converts
    ViL checkpoints: stage 3-4 ``qkv`` is split into ``query``/``kv``, the 27^2 stage-3
    table fits the w=7 chunk table as it is, the 13^2 stage-4 table is resized
    bilinearly, and the long-short layers of stages 1-2 load unchanged (their
    window tables are never resized; another size is an error). The
    classification layout is ``attn_types=('long_short', 'long_short', 'full',
    'full')``.

    Variants: ``'medium'`` (depths 1,4,16,1) and ``'base'`` (1,8,24,1) from the
    paper, ``'tiny'`` and ``'small'`` with the ViL-T/S depths; dims 96..768 (48..384
    for tiny). ``r = 8``; ``w = 7`` at 224, ``window_size=8`` for the 384 models;
    global tokens 1,1,1,0.

    Args:
        arch (str | dict): A preset of ``LS_ARCH_ZOO`` or a dict, as for :class:`ViL`.
            Default: ``'medium'``.
        attn_types (str | Sequence[str]): Attention per stage. Default:
            ``('long_short', 'long_short', 'sliding_chunk', 'sliding_chunk')``.
        **kwargs: Every other argument of :class:`ViL` (``dp_rank`` defaults to 8;
            ``masking_mode``, ``shift_mode`` and ``random_shift`` act on the
            sliding-chunk stages only).
    """

    arch_zoo = LS_ARCH_ZOO
    attention_ops = (LONG_SHORT, SLIDING_CHUNK)

    def __init__(self, arch='medium', attn_types=LS_ATTN_TYPES, **kwargs):
        super().__init__(arch=arch, attn_types=attn_types, **kwargs)


def set_random_shift(model, enabled):
    """Turn random-shift training on or off in every ViL attention layer of ``model``.

    Returns:
        int: The number of attention layers changed.
    """
    layers = [m for m in model.modules() if isinstance(m, SlidingChunkAttention)]
    if enabled:
        for m in layers:
            check_modes(m.masking_mode, m.shift_mode, random_shift=True)
    for m in layers:
        m.random_shift = enabled
    return len(layers)
