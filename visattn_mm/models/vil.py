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
import torch.utils.checkpoint as cp
from timm.layers import DropPath, trunc_normal_

from ..ops.long_short import (dynamic_projection, long_short_attention, long_short_rpb_index,
                              long_short_rpb_table_size)
from ..ops.common import dense_attention
from ..ops.rel_pos import (full_attention_rpb_index, resize_1d_table, resize_rpb_grid, resize_rpb_table,
                           sliding_chunk_rpb_index)
from ..ops.sliding_chunk import SHIFT_MODES, check_modes, sliding_chunk_attention
from .base import DenseBackbone
from .layers import (Mlp, check_arch, check_attn_impl, check_int, check_mlp_ratio, check_stage_args,
                     check_stage_lengths, init_transformer_weights, linear_drop_path_rates, pad_to_multiple)

ARCH_ZOO = {
    'tiny': dict(depths=(1, 1, 9, 1), embed_dims=(48, 96, 192, 384), num_heads=(1, 3, 3, 6)),
    'small': dict(depths=(1, 2, 8, 1), embed_dims=(96, 192, 384, 768), num_heads=(3, 3, 6, 12)),
    'medium': dict(depths=(1, 4, 16, 1), embed_dims=(96, 192, 384, 768), num_heads=(3, 3, 6, 12)),
    'base': dict(depths=(1, 8, 24, 1), embed_dims=(96, 192, 384, 768), num_heads=(3, 3, 6, 12)),
}
for _alias, _name in (('t', 'tiny'), ('s', 'small'), ('m', 'medium'), ('b', 'base')):
    ARCH_ZOO[_alias] = ARCH_ZOO[_name]

# ViL-LS (Transformer-LS paper Table 5: Medium and Base; Tiny and Small are the ViL
# depths with long-short attention). Same depths, dims and heads as ViL.
LS_ARCH_ZOO = dict(ARCH_ZOO)

PATCH_SIZES = (4, 2, 2, 2)
NUM_GLOBAL_TOKENS = (1, 1, 1, 0)
ATTN_TYPES = ('sliding_chunk', 'full', 'long_short')
LS_ATTN_TYPES = ('long_short', 'long_short', 'sliding_chunk', 'sliding_chunk')
LN_EPS = 1e-6  # every LayerNorm of the official ViL code
DUAL_LN_EPS = 1e-5  # Transformer-LS' DualLN keeps torch's default


def _global_token_bias(g2l_bias, g2g_bias, num_local):
    """(heads, G, G + N) bias of the global queries: g2g, then g2l[0] for every local key."""
    heads, num_global = g2g_bias.shape[:2]
    return torch.cat([g2g_bias, g2l_bias[0][..., None].expand(heads, num_global, num_local)], dim=-1)


class _GlobalRPB(nn.Module):
    """Biases between global and local tokens, shared by both attention types.

    ``g2l_relative_position_bias[0]`` biases global->local logits, ``[1]`` local->
    global; ``g2g_relative_position_bias`` global->global (official key names).
    """

    def _init_global_bias(self, num_heads, num_global):
        self.g2l_relative_position_bias = nn.Parameter(torch.zeros(2, num_heads, num_global))
        self.g2g_relative_position_bias = nn.Parameter(torch.zeros(num_heads, num_global, num_global))
        trunc_normal_(self.g2l_relative_position_bias, std=0.02)
        trunc_normal_(self.g2g_relative_position_bias, std=0.02)


class SlidingChunkAttention(_GlobalRPB):
    """ViL attention: sliding-chunk local attention plus global tokens.

    Local tokens attend to the keys of their own and neighbouring ``w x w``
    chunks and to all global tokens; global tokens attend to every token.
    ``query``, ``kv`` and ``proj`` are shared by local and global tokens (the
    official ``*_global`` keys are copies of them).

    Args:
        dim (int): Channels.
        num_heads (int): Attention heads.
        window (int): Chunk size ``w``.
        num_global (int): Global tokens at the front of the sequence.
        qkv_bias (bool): Bias in ``query``/``kv``.
        use_rpb (bool): Relative positional bias (table of ``(4w-1)^2`` rows per head,
            plus global-token biases).
        masking_mode (int): 0, -1 or 1; see :mod:`visattn_mm.ops.sliding_chunk`.
        shift_mode (int): Neighbour set used when random shift is off: 0 (all 8),
            -1 (own chunk only) or a fixed 1..8.
        random_shift (bool): While training, draw the neighbour (1..8) at random at
            every forward pass. Toggled by :class:`RandomShiftHook`.
        attn_drop (float): Dropout on attention probabilities.
        proj_drop (float): Dropout after ``proj``.
        attn_impl (str): 'auto', 'fast' or 'math' (see :mod:`visattn_mm.ops.impl`).
    """

    def __init__(self, dim, num_heads, window=7, num_global=1, qkv_bias=True, use_rpb=True,
                 masking_mode=0, shift_mode=0, random_shift=False, attn_drop=0.0, proj_drop=0.0,
                 attn_impl='auto'):
        super().__init__()
        check_modes(masking_mode, shift_mode)
        check_modes(masking_mode, 1 if random_shift else shift_mode)
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.window = window
        self.num_global = num_global
        self.masking_mode = masking_mode
        self.shift_mode = shift_mode
        self.random_shift = random_shift
        self.attn_drop = attn_drop
        self.attn_impl = attn_impl
        self.query = nn.Linear(dim, dim, bias=qkv_bias)
        self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.use_rpb = use_rpb
        if use_rpb:
            self.local_relative_position_bias_table = nn.Parameter(
                torch.zeros((4 * window - 1) ** 2, num_heads))
            trunc_normal_(self.local_relative_position_bias_table, std=0.02)
            # Derived from `window`; never loaded from checkpoints.
            self.register_buffer('relative_position_index', sliding_chunk_rpb_index(window),
                                 persistent=False)
            if num_global:
                self._init_global_bias(num_heads, num_global)

    def resolve_shift_mode(self):
        """The neighbour set for this forward pass (drawn here when random shift is on).

        Called outside gradient checkpointing so that recomputation reuses the draw.
        """
        if self.random_shift and self.training:
            return int(torch.randint(1, 9, ()).item())
        return self.shift_mode

    def forward(self, x, hw, shift_mode=None):
        """x: (B, G + H*W, C) with the global tokens first; hw: (H, W)."""
        if shift_mode is None:
            shift_mode = self.resolve_shift_mode()
        b, n, c = x.shape
        g, heads, (h, w) = self.num_global, self.num_heads, hw
        q = (self.query(x) * self.scale).reshape(b, n, heads, -1).transpose(1, 2)
        k, v = self.kv(x).reshape(b, n, 2, heads, -1).permute(2, 0, 3, 1, 4)
        local_bias = l2g_bias = global_bias = None
        if self.use_rpb:
            w2 = self.window ** 2
            local_bias = self.local_relative_position_bias_table[self.relative_position_index]
            local_bias = local_bias.reshape(w2, 9 * w2, heads).permute(2, 0, 1)
            if g:
                l2g_bias = self.g2l_relative_position_bias[1]
                global_bias = _global_token_bias(self.g2l_relative_position_bias,
                                                 self.g2g_relative_position_bias, n - g)
        dropout_p = self.attn_drop if self.training else 0.0
        out = sliding_chunk_attention(
            q[:, :, g:], k[:, :, g:], v[:, :, g:], h, w, self.window,
            global_k=k[:, :, :g] if g else None, global_v=v[:, :, :g] if g else None,
            local_bias=local_bias, l2g_bias=l2g_bias, masking_mode=self.masking_mode,
            shift_mode=shift_mode, dropout_p=dropout_p, impl=self.attn_impl)
        if g:
            glob = dense_attention(q[:, :, :g], k, v, bias=global_bias, dropout_p=dropout_p)
            out = torch.cat([glob, out], dim=2)
        out = out.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(out))


class FullAttention(_GlobalRPB):
    """Full attention with a Swin-style RPB table sized for one map.

    This is the official classification models' attention in stages 3-4. The
    table is built for ``rpb_size`` and used as it is there; a map of another size
    ``(h, w)`` uses the table bilinearly resized to its ``(2h-1) x (2w-1)`` offset
    grid, the resize the checkpoint loader applies to tables of another size
    (:func:`~visattn_mm.ops.rel_pos.resize_rpb_grid`), so any input size works.

    Args:
        dim (int): Channels.
        num_heads (int): Attention heads.
        rpb_size (tuple[int, int]): Map size ``(H, W)`` the RPB table is built for.
        num_global (int): Global tokens at the front of the sequence.
        qkv_bias (bool): Bias in ``qkv``.
        use_rpb (bool): Use the RPB table and global-token biases.
        attn_drop (float): Dropout on attention probabilities.
        proj_drop (float): Dropout after ``proj``.
    """

    def __init__(self, dim, num_heads, rpb_size, num_global=1, qkv_bias=True, use_rpb=True,
                 attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.num_global = num_global
        self.rpb_size = tuple(rpb_size)
        self.attn_drop = attn_drop
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.use_rpb = use_rpb
        if use_rpb:
            rh, rw = self.rpb_size
            self.local_relative_position_bias_table = nn.Parameter(
                torch.zeros((2 * rh - 1) * (2 * rw - 1), num_heads))
            trunc_normal_(self.local_relative_position_bias_table, std=0.02)
            self.register_buffer('relative_position_index', full_attention_rpb_index(rh, rw),
                                 persistent=False)
            if num_global:
                self._init_global_bias(num_heads, num_global)

    def resolve_shift_mode(self):
        return 0

    def _local_bias(self, hw):
        """``(heads, h*w, h*w)`` local bias of an ``hw`` map: the table as built for
        ``rpb_size``, or resized to the map's offset grid."""
        if hw == self.rpb_size:
            table, index = self.local_relative_position_bias_table, self.relative_position_index
        else:
            rh, rw = self.rpb_size
            table = resize_rpb_grid(self.local_relative_position_bias_table, (2 * rh - 1, 2 * rw - 1),
                                    (2 * hw[0] - 1, 2 * hw[1] - 1))
            index = full_attention_rpb_index(*hw).to(table.device)
        return table[index].permute(2, 0, 1)

    def forward(self, x, hw, shift_mode=None):
        b, n, c = x.shape
        g, heads = self.num_global, self.num_heads
        bias = None
        if self.use_rpb:
            bias = self._local_bias(tuple(hw))                 # (heads, N_loc, N_loc)
            if g:
                num_local = n - g
                l2g = self.g2l_relative_position_bias[1][:, None, :].expand(heads, num_local, g)
                bias = torch.cat([
                    _global_token_bias(self.g2l_relative_position_bias,
                                       self.g2g_relative_position_bias, num_local),
                    torch.cat([l2g, bias], dim=-1)], dim=1)
        q, k, v = self.qkv(x).reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
        out = dense_attention(q * self.scale, k, v, bias=bias,
                              dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, c)))


class LongShortAttention(nn.Module):
    """Transformer-LS long-short attention (ViL-LS stages 1-2), as the official code computes it.

    1. ``q, k, v`` from the fused ``qkv``; ``q`` scaled by ``head_dim ** -0.5``.
    2. DualLN, part 1: ``dual_ln_full`` on ``k`` and ``v`` of all tokens (global
       included), over all channels, before the heads are split.
    3. Dynamic projection: ``P = softmax_tokens(to_dynamic_projection(x_local))`` in
       fp32 over the ``H * W`` local tokens (never padding); ``K_bar = P k``,
       ``V_bar = P v`` per head, heads merged, DualLN part 2 (``dual_ln_dp``), split.
    4. Local queries: one fp32 softmax over ``[K_bar | segment patch | global keys]``
       (:func:`~visattn_mm.ops.long_short.long_short_attention`); window RPB only.
    5. Global queries attend to the global keys/values and to the local tokens'
       attention outputs (as keys and values), without bias or dropout.
    6. ``proj`` on ``[global, local]``.

    The official code handles one global token (it multiplies the local
    probabilities with ``v_global`` element-wise); ``num_global > 1`` uses the
    matrix product that this generalises to, so every local query sees all global
    tokens and every global query all global tokens and local outputs.

    Args:
        dim (int): Channels.
        num_heads (int): Attention heads.
        window (int): Segment size ``w`` (7 at 224, 8 at 384).
        dp_rank (int): Rank ``r`` of the dynamic projection.
        num_global (int): Global tokens at the front of the sequence.
        qkv_bias (bool): Bias in ``qkv``.
        use_rpb (bool): Window relative positional bias (a table of
            ``2(w+p-1)(2p+w+1)+1`` rows per head, indexed with the official aliasing).
        attn_drop (float): Dropout on the local queries' attention probabilities.
        proj_drop (float): Dropout after ``proj``.
        attn_impl (str): 'auto', 'fast' or 'math' (see :mod:`visattn_mm.ops.impl`).
    """

    def __init__(self, dim, num_heads, window=7, dp_rank=8, num_global=1, qkv_bias=True,
                 use_rpb=True, attn_drop=0.0, proj_drop=0.0, attn_impl='auto'):
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.window = window
        self.num_global = num_global
        self.attn_drop = attn_drop
        self.attn_impl = attn_impl
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        self.to_dynamic_projection = nn.Linear(dim, dp_rank * num_heads)
        self.dual_ln_dp = nn.LayerNorm(dim, eps=DUAL_LN_EPS)
        self.dual_ln_full = nn.LayerNorm(dim, eps=DUAL_LN_EPS)
        self.use_rpb = use_rpb
        if use_rpb:
            self.local_relative_position_bias_table = nn.Parameter(
                torch.zeros(long_short_rpb_table_size(window), num_heads))
            trunc_normal_(self.local_relative_position_bias_table, std=0.02)
            # Derived from `window`; never loaded from checkpoints.
            self.register_buffer('relative_position_index', long_short_rpb_index(window),
                                 persistent=False)

    def resolve_shift_mode(self):
        """Random shift does not apply to long-short attention."""
        return 0

    def _project(self, weights, x):
        """``K_bar`` or ``V_bar``: ``P x`` per head, then ``dual_ln_dp`` over all channels.

        Args:
            weights (Tensor): ``P``, ``(B, heads, r, N)``.
            x (Tensor): Local keys or values, ``(B, heads, N, d)``.

        Returns:
            Tensor: ``(B, heads, r, d)``.
        """
        b, heads, rank, _ = weights.shape
        merged = (weights.to(x.dtype) @ x).transpose(1, 2).reshape(b, rank, -1)
        return self.dual_ln_dp(merged).reshape(b, rank, heads, -1).transpose(1, 2)

    def forward(self, x, hw, shift_mode=None):
        """x: (B, G + H*W, C) with the global tokens first; hw: (H, W); shift_mode is ignored."""
        b, n, c = x.shape
        g, heads = self.num_global, self.num_heads
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        k, v = self.dual_ln_full(k), self.dual_ln_full(v)
        q, k, v = (t.reshape(b, n, heads, -1).transpose(1, 2) for t in (q * self.scale, k, v))
        weights = dynamic_projection(self.to_dynamic_projection(x[:, g:]), heads)
        local_bias = None
        if self.use_rpb:
            local_bias = self.local_relative_position_bias_table[self.relative_position_index]
            local_bias = local_bias.permute(2, 0, 1)          # (heads, w*w, (w+2p)^2)
        out = long_short_attention(
            q[:, :, g:], k[:, :, g:], v[:, :, g:], *hw, self.window,
            k_bar=self._project(weights, k[:, :, g:]), v_bar=self._project(weights, v[:, :, g:]),
            global_k=k[:, :, :g] if g else None, global_v=v[:, :, :g] if g else None,
            local_bias=local_bias, dropout_p=self.attn_drop if self.training else 0.0, impl=self.attn_impl)
        if g:
            glob = dense_attention(q[:, :, :g], torch.cat([k[:, :, :g], out], dim=2),
                                   torch.cat([v[:, :, :g], out], dim=2))
            out = torch.cat([glob, out], dim=2)
        out = out.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(out))


class ViLBlock(nn.Module):
    """Pre-LN transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, dim, attn, mlp_ratio=4.0, drop=0.0, drop_path=0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.attn = attn
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x, hw, shift_mode=None):
        x = x + self.drop_path(self.attn(self.norm1(x), hw, shift_mode))
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
            x = torch.cat([glob.expand(b, -1, -1), x], dim=1)
        return self.pos_drop(x), (h, w)


class ViLStage(nn.Module):
    """One E-ViT stage: patch embedding with global tokens, then blocks."""

    def __init__(self, patch_embed, blocks, with_cp=False):
        super().__init__()
        self.patch_embed = patch_embed
        self.blocks = nn.ModuleList(blocks)
        self.with_cp = with_cp

    def forward(self, x):
        """NCHW in; tokens ``(B, H*W, C)`` without global tokens and ``(H, W)`` out."""
        x, hw = self.patch_embed(x)
        for block in self.blocks:
            # Draw the random-shift neighbour outside checkpointing so the recomputed
            # forward pass uses the same keys.
            shift_mode = block.attn.resolve_shift_mode()
            if self.with_cp and x.requires_grad:
                x = cp.checkpoint(block, x, hw, shift_mode, use_reentrant=False)
            else:
                x = block(x, hw, shift_mode)
        return x[:, self.patch_embed.num_global:], hw


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
        out_indices (Sequence[int]): Stages (0-3) whose local tokens are returned as
            NCHW maps, each after its own LayerNorm ``norm{i}``. Default: (0, 1, 2, 3).
        frozen_stages (int): -1 freezes nothing; 0 freezes the first patch
            embedding; ``i >= 1`` freezes stages 1..i (and their output norms).
        norm_eval (bool): Keep BatchNorm layers in eval mode while training (ViL has
            only LayerNorms, so this only affects BatchNorms added by subclasses).
        with_cp (bool): Gradient checkpointing per block, saving memory.
        attn_impl (str): Implementation of the sliding-chunk and long-short attention:
            'fast' (fused ``scaled_dot_product_attention``), 'math' (explicit softmax,
            the reference) or 'auto' (per device, as measured; see
            :mod:`visattn_mm.ops.impl`). Full attention has one path. Default: 'auto'.
        pretrained (str, optional): Deprecated, use ``init_cfg``.
        init_cfg (dict, optional): ``dict(type='Pretrained', checkpoint=...)``.
    """

    arch_zoo = ARCH_ZOO

    def __init__(self, arch='small', in_channels=3, window_size=7, num_global_tokens=None,
                 attn_types='sliding_chunk', dp_rank=8, masking_mode=0, shift_mode=0,
                 random_shift=False, use_rpb=True, pretrain_img_size=224, qkv_bias=True,
                 mlp_ratio=4.0, drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.1,
                 out_indices=(0, 1, 2, 3), frozen_stages=-1, norm_eval=False, with_cp=False,
                 attn_impl='auto', pretrained=None, init_cfg=None):
        name = type(self).__name__
        super().__init__(pretrained=pretrained, init_cfg=init_cfg)
        check_attn_impl(attn_impl, name)
        spec = check_arch(arch, self.arch_zoo, ('depths', 'embed_dims', 'num_heads'), name)
        depths, dims, heads = spec['depths'], spec['embed_dims'], spec['num_heads']
        patch_sizes = spec.get('patch_sizes', PATCH_SIZES)
        if num_global_tokens is None:
            num_global_tokens = spec.get('num_global_tokens', NUM_GLOBAL_TOKENS)
        num_stages = len(depths)
        windows = self._per_stage(window_size, num_stages, 'window_size')
        attn_types = self._per_stage(attn_types, num_stages, 'attn_types')
        dp_ranks = self._per_stage(dp_rank, num_stages, 'dp_rank')
        check_stage_lengths(name, num_stages, embed_dims=dims, num_heads=heads, patch_sizes=patch_sizes,
                            num_global_tokens=num_global_tokens)
        for i, (d, h) in enumerate(zip(dims, heads)):
            if d % h:
                raise ValueError(f'{name}: embed_dims[{i}]={d} is not divisible by num_heads[{i}]={h}')
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
        if shift_mode not in SHIFT_MODES:
            raise ValueError(f'{name}: shift_mode must be one of {SHIFT_MODES}, got {shift_mode!r}')
        try:
            check_modes(masking_mode, 1 if random_shift else shift_mode)
        except ValueError as err:
            raise ValueError(f'{name}: {err}') from None
        out_indices = check_stage_args(name, num_stages, out_indices, frozen_stages, drop_path_rate)

        self.out_indices = out_indices
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.num_stages = num_stages
        self.embed_dims = tuple(dims)
        self.strides = tuple(math.prod(patch_sizes[:i + 1]) for i in range(num_stages))
        self.num_global_tokens = tuple(num_global_tokens)
        img_h, img_w = (pretrain_img_size,) * 2 if isinstance(pretrain_img_size, int) else pretrain_img_size
        drop_paths = linear_drop_path_rates(drop_path_rate, depths)

        self.stages = nn.ModuleList()
        in_dim, stride = in_channels, 1
        for i in range(num_stages):
            stride *= patch_sizes[i]
            table_size = (math.ceil(img_h / stride), math.ceil(img_w / stride))
            blocks = []
            for j in range(depths[i]):
                common = dict(num_global=num_global_tokens[i], qkv_bias=qkv_bias, use_rpb=use_rpb,
                              attn_drop=attn_drop_rate, proj_drop=drop_rate)
                if attn_types[i] == 'full':
                    attn = FullAttention(dims[i], heads[i], rpb_size=table_size, **common)
                elif attn_types[i] == 'long_short':
                    attn = LongShortAttention(dims[i], heads[i], window=windows[i],
                                              dp_rank=dp_ranks[i], attn_impl=attn_impl, **common)
                else:
                    attn = SlidingChunkAttention(dims[i], heads[i], window=windows[i],
                                                 masking_mode=masking_mode, shift_mode=shift_mode,
                                                 random_shift=random_shift, attn_impl=attn_impl, **common)
                blocks.append(ViLBlock(dims[i], attn, mlp_ratio, drop_rate,
                                       drop_paths[sum(depths[:i]) + j]))
            embed = ViLPatchEmbed(in_dim, dims[i], patch_sizes[i], num_global_tokens[i],
                                  ape_size=None if use_rpb else table_size, drop=drop_rate)
            self.stages.append(ViLStage(embed, blocks, with_cp))
            in_dim = dims[i]
        for i in out_indices:
            self.add_module(f'norm{i}', nn.LayerNorm(dims[i], eps=LN_EPS))

        self.apply(init_transformer_weights)
        self._freeze_stages()
        self._register_load_state_dict_pre_hook(self._adapt_checkpoint_tensors)

    def checkpoint_filter(self, state_dict, target_keys, report):
        """Official-layout conversion used by :func:`load_pretrained`."""
        return vil_checkpoint_filter(state_dict, target_keys, report)

    def adaptable_keys(self, state_dict):
        """Keys of ``state_dict`` whose shape differs from ours but that the pre-hook can adapt.

        Raises:
            ValueError: For a long-short window RPB table of another size (see
                :meth:`_check_long_short_tables`).
        """
        self._check_long_short_tables(state_dict)
        own = self.state_dict()
        return {k for k, v in state_dict.items()
                if k in own and v.shape != own[k].shape
                and adapt_position_tensor(k.rsplit('.', 1)[-1], v, own[k].shape) is not None}

    def _adapt_checkpoint_tensors(self, state_dict, prefix, *args):
        """Pre-hook of every load path (init_cfg, load_from, resume, load_state_dict).

        Drops the derived ``relative_position_index`` buffers (official checkpoints
        carry them) and adapts position tables and global tokens of another size.
        Long-short window tables are never adapted: another size raises a ValueError.
        """
        self._check_long_short_tables(state_dict, prefix)
        own = self.state_dict()
        for key in [k for k in state_dict if k.startswith(prefix)]:
            local = key[len(prefix):]
            if local.endswith('relative_position_index'):
                del state_dict[key]
            elif local in own and state_dict[key].shape != own[local].shape:
                adapted = adapt_position_tensor(local.rsplit('.', 1)[-1], state_dict[key], own[local].shape)
                if adapted is not None:
                    state_dict[key] = adapted

    def _check_long_short_tables(self, state_dict, prefix=''):
        """Refuse a long-short window RPB table with another number of rows.

        Its index aliases offsets (see :mod:`visattn_mm.ops.long_short`), so the table
        has no 2-D grid to resize: another row count means another window ``w``, and a
        resized table would silently mean something else.

        Args:
            state_dict (dict): Checkpoint tensors.
            prefix (str): Prefix of this module's keys in ``state_dict``.

        Raises:
            ValueError: Naming the key, both shapes and the window size that the
                checkpoint's table belongs to.
        """
        for module_name, module in self.named_modules():
            if not (isinstance(module, LongShortAttention) and module.use_rpb):
                continue
            key = f'{prefix}{module_name}.local_relative_position_bias_table'
            own = module.local_relative_position_bias_table.shape
            theirs = state_dict[key].shape if key in state_dict else own
            if theirs == own or theirs[1:] != own[1:]:
                continue  # absent, fitting, or another head count (an ordinary mismatch)
            rows = theirs[0]
            fits = [w for w in range(1, 65) if long_short_rpb_table_size(w) == rows]
            hint = (f'the checkpoint was trained with window_size={fits[0]}: build the model with it'
                    if fits else 'no window size gives that many rows')
            raise ValueError(
                f'{key}: the checkpoint\'s long-short window RPB table has {rows} rows, this model\'s '
                f'{own[0]} (window_size={module.window}). These tables index offsets with aliasing and '
                f'cannot be resized; {hint}.')

    @classmethod
    def _per_stage(cls, value, num_stages, name):
        values = tuple(value) if isinstance(value, (list, tuple)) else (value,) * num_stages
        if len(values) != num_stages:
            raise ValueError(f'{cls.__name__}: {name} needs 1 or {num_stages} entries, got {value!r}')
        return values

    def stage_modules(self, i):
        """Patch embedding, the whole stage and (if built) its output norm (0-based ``i``)."""
        norm = getattr(self, f'norm{i}', None)
        stage = self.stages[i]
        return (stage.patch_embed, stage) + ((norm,) if norm is not None else ())

    def output_norm(self, i):
        """``norm{i}`` (built for ``out_indices`` only)."""
        return getattr(self, f'norm{i}', None)

    def _run_stages(self, x):
        for i, stage in enumerate(self.stages):
            tokens, (h, w) = stage(x)
            yield i, tokens, (h, w)
            x = tokens.transpose(1, 2).reshape(tokens.shape[0], -1, h, w)


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

    def __init__(self, arch='medium', attn_types=LS_ATTN_TYPES, **kwargs):
        super().__init__(arch=arch, attn_types=attn_types, **kwargs)


def adapt_position_tensor(name, value, target_shape):
    """Fit a checkpoint's position table or global-token tensor to another size.

    * ``local_relative_position_bias_table``: bilinear resize of the square
      offset grid (e.g. a 13x13 full-attention table of a 7x7 map -> 27x27).
      Long-short window tables (same name, no grid) never get here with another
      size: :meth:`ViL._check_long_short_tables` refuses them first.
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
    their originals; index buffers and the classification head are dropped; the
    final ``norm`` becomes the last stage's output norm when there is one. Our own
    layouts (dense, or the classifier's ``backbone.`` keys) keep their names; in all
    layouts a full-attention ``qkv`` is split where the target stage is sliding-chunk.
    Position tables of another size are resized later by the load pre-hook.
    """
    if 'layer1.0.proj.weight' in state_dict:
        state_dict = _convert_official_vil(state_dict, target_keys, report)
    out = _split_full_qkv(state_dict, target_keys, report)
    for key in target_keys:
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
            new = f'norm{stages[-1] - 1}.{key[len("norm."):]}'
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


def set_random_shift(model, enabled):
    """Turn random-shift training on or off in every ViL attention layer of ``model``.

    Returns:
        int: The number of attention layers changed.
    """
    layers = [m for m in model.modules() if isinstance(m, SlidingChunkAttention)]
    if enabled:
        for m in layers:
            check_modes(m.masking_mode, 1)
    for m in layers:
        m.random_shift = enabled
    return len(layers)
