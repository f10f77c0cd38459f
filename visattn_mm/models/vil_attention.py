"""The attention layers of ViL and ViL-LS: sliding-chunk, full and long-short.

Each is a module holding the projections and bias tables (official key names) and
calling a pure function of :mod:`visattn_mm.ops` for the attention itself. All take
``(B, G + H*W, C)`` tokens with the ``G`` global tokens first and the map size ``(H, W)``.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import trunc_normal_

from ..ops.common import dense_attention
from ..ops.indexing import check_modes
from ..ops.long_short import dynamic_projection, long_short_attention
from ..ops.rel_pos import (
    cached_full_attention_rpb_index,
    full_attention_rpb_index,
    long_short_rpb_index,
    long_short_rpb_table_size,
    resize_rpb_grid,
    sliding_chunk_rpb_index,
)
from ..ops.sliding_chunk import sliding_chunk_attention

DUAL_LN_EPS = 1e-5  # Transformer-LS' DualLN keeps torch's default


class _ContiguousGrad(torch.autograd.Function):
    """The identity; backward hands on the gradient as a new contiguous tensor."""

    @staticmethod
    def forward(ctx, tensor):
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone(memory_format=torch.contiguous_format)


def with_contiguous_grad(tensor):
    """``tensor``, whose gradient arrives as a new contiguous tensor, with the strides of a parameter.

    A parameter concatenated with activations gets a slice of the concatenation's gradient. When
    every dimension but the last is 1 (the g2g bias with one head and one global token is
    ``(1, 1, 1)``; the global tokens of a batch of one are ``(1, 1, C)``), autograd keeps that slice
    as the parameter's gradient, since it ignores the strides of size-1 dimensions; DDP compares all
    of them with its bucket's and warns "Grad strides do not match bucket view strides" (and copies
    the gradient at every step).
    """
    return _ContiguousGrad.apply(tensor)


def _global_token_bias(g2l_bias, g2g_bias, num_local):
    """(heads, G, G + N) bias of the global queries: g2g, then g2l[0] for every local key."""
    heads, num_global = g2g_bias.shape[:2]
    return torch.cat(
        [with_contiguous_grad(g2g_bias), g2l_bias[0][..., None].expand(heads, num_global, num_local)], dim=-1
    )


def _split_heads(tokens, parts, heads):
    """``parts`` tensors ``(B, heads, n, d)`` from ``(B, n, parts * heads * d)`` tokens (or ``(B, n, parts, C)``).

    Unbound where the parts lie, so that backward stacks their gradients straight into the
    tokens' layout (one copy; unbinding a permuted view needs a second copy back).
    """
    b, n = tokens.shape[:2]
    return tuple(t.transpose(1, 2) for t in tokens.reshape(b, n, parts, heads, -1).unbind(2))


def _merge_heads(glob, local, shape):
    """``(B, G + N, C)`` tokens from the ``(B, heads, ., d)`` outputs of the global queries (or None) and
    the local ones, concatenated heads-last: one copy at most (none for the Triton ops' outputs, which
    are views of heads-last storage, without global tokens)."""
    tokens = local.transpose(1, 2)
    if glob is not None:
        tokens = torch.cat([glob.transpose(1, 2), tokens], dim=1)
    return tokens.reshape(shape)


class ViLAttentionBase(nn.Module):
    """Base of the three attentions: what they share, under the official key names.

    The query/key/value projections (``qkv``, or ``query`` and ``kv`` where
    :attr:`split_query`), the output projection ``proj`` and its dropout are built here;
    a subclass adds its own layers and then its bias tables (:meth:`_init_bias_tables`).
    ``local_relative_position_bias_table`` (rows x heads) is read through the
    non-persistent ``relative_position_index`` buffer (derived from the window or map
    size, never loaded). With global tokens, ``g2l_relative_position_bias[0]`` biases
    global->local logits, ``[1]`` local->global, and ``g2g_relative_position_bias``
    global->global.

    Args:
        dim (int): Channels.
        num_heads (int): Attention heads.
        num_global (int): Global tokens at the front of the sequence. Default: 1.
        qkv_bias (bool): Bias in the query/key/value projections. Default: True.
        use_rpb (bool): Relative positional bias: the subclass's local table and, where it
            has them, the global-token biases. Default: True.
        attn_drop (float): Dropout on attention probabilities. Default: 0.
        proj_drop (float): Dropout after ``proj``. Default: 0.
    """

    #: Separate ``query`` and ``kv`` projections instead of one ``qkv`` (the official
    #: sliding-chunk layers' keys).
    split_query = False

    def __init__(self, dim, num_heads, num_global=1, qkv_bias=True, use_rpb=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.num_global = num_global
        self.use_rpb = use_rpb
        self.attn_drop = attn_drop
        if self.split_query:
            self.query = nn.Linear(dim, dim, bias=qkv_bias)
            self.kv = nn.Linear(dim, 2 * dim, bias=qkv_bias)
        else:
            self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def _init_bias_tables(self, index, table_rows, global_biases=True):
        """Create the tables (trunc-normal, std 0.02) when ``use_rpb``; ``index`` indexes the local one;
        ``global_biases``: also the global-token biases, if there are global tokens."""
        if not self.use_rpb:
            return
        num_heads, num_global = self.num_heads, self.num_global if global_biases else 0
        self.local_relative_position_bias_table = nn.Parameter(torch.zeros(table_rows, num_heads))
        trunc_normal_(self.local_relative_position_bias_table, std=0.02)
        self.register_buffer('relative_position_index', index, persistent=False)
        if num_global:
            self.g2l_relative_position_bias = nn.Parameter(torch.zeros(2, num_heads, num_global))
            self.g2g_relative_position_bias = nn.Parameter(torch.zeros(num_heads, num_global, num_global))
            trunc_normal_(self.g2l_relative_position_bias, std=0.02)
            trunc_normal_(self.g2g_relative_position_bias, std=0.02)


class SlidingChunkAttention(ViLAttentionBase):
    """ViL attention: sliding-chunk local attention plus global tokens.

    Local tokens attend to the keys of their own and neighbouring ``w x w``
    chunks and to all global tokens; global tokens attend to every token.
    ``query``, ``kv`` and ``proj`` are shared by local and global tokens (the
    official ``*_global`` keys are copies of them).

    Args:
        dim (int): Channels.
        num_heads (int): Attention heads.
        window (int): Chunk size ``w``. Default: 7.
        masking_mode (int): 0, -1 or 1; see :mod:`visattn_mm.ops.sliding_chunk`. Default: 0.
        shift_mode (int): Neighbour set used when random shift is off: 0 (all 8),
            -1 (own chunk only) or a fixed 1..8. Default: 0.
        random_shift (bool): While training, draw the neighbour (1..8) at random at
            every forward pass. Toggled by :class:`RandomShiftHook`. Default: False.
        attn_impl (str): The attention's path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.
        **kwargs: ``num_global``, ``qkv_bias``, ``use_rpb`` (a table of ``(4w-1)^2`` rows per
            head, plus global-token biases), ``attn_drop``, ``proj_drop``: see
            :class:`ViLAttentionBase`.
    """

    split_query = True

    def __init__(
        self, dim, num_heads, window=7, masking_mode=0, shift_mode=0, random_shift=False, attn_impl='auto', **kwargs
    ):
        check_modes(masking_mode, shift_mode, random_shift)
        super().__init__(dim, num_heads, **kwargs)
        self.window = window
        self.masking_mode = masking_mode
        self.shift_mode = shift_mode
        self.random_shift = random_shift
        self.attn_impl = attn_impl
        self._init_bias_tables(sliding_chunk_rpb_index(window), (4 * window - 1) ** 2)

    def resolve_shift_mode(self):
        """The neighbour set for this forward pass (drawn here when random shift is on).

        Called outside gradient checkpointing so that recomputation reuses the draw.
        """
        if self.random_shift and self.training:
            return int(torch.randint(1, 9, ()).item())
        return self.shift_mode

    def forward(self, x, hw, shift_mode=None):
        """x: (B, G + H*W, C) with the global tokens first; hw: (H, W); shift_mode: see
        :meth:`resolve_shift_mode` (drawn here if None)."""
        if shift_mode is None:
            shift_mode = self.resolve_shift_mode()
        b, n, c = x.shape
        g, heads, (h, w) = self.num_global, self.num_heads, hw
        q = (self.query(x) * self.scale).reshape(b, n, heads, -1).transpose(1, 2)
        k, v = _split_heads(self.kv(x), 2, heads)
        local_bias = l2g_bias = global_bias = None
        if self.use_rpb:
            w2 = self.window**2
            local_bias = self.local_relative_position_bias_table[self.relative_position_index]
            local_bias = local_bias.reshape(w2, 9 * w2, heads).permute(2, 0, 1)
            if g:
                l2g_bias = self.g2l_relative_position_bias[1]
                global_bias = _global_token_bias(
                    self.g2l_relative_position_bias, self.g2g_relative_position_bias, n - g
                )
        dropout_p = self.attn_drop if self.training else 0.0
        # The global tokens lead q, k, v: the fused path gathers from the whole tensors.
        out = sliding_chunk_attention(
            q,
            k,
            v,
            h,
            w,
            self.window,
            local_bias=local_bias,
            l2g_bias=l2g_bias,
            masking_mode=self.masking_mode,
            shift_mode=shift_mode,
            dropout_p=dropout_p,
            impl=self.attn_impl,
            leading_global=g,
        )
        glob = dense_attention(q[:, :, :g], k, v, bias=global_bias, dropout_p=dropout_p) if g else None
        return self.proj_drop(self.proj(_merge_heads(glob, out, (b, n, c))))


class FullAttention(ViLAttentionBase):
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
        **kwargs: ``num_global``, ``qkv_bias``, ``use_rpb`` (the RPB table and global-token
            biases), ``attn_drop``, ``proj_drop``: see :class:`ViLAttentionBase`.
    """

    def __init__(self, dim, num_heads, rpb_size, **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.rpb_size = tuple(rpb_size)
        rh, rw = self.rpb_size
        self._init_bias_tables(full_attention_rpb_index(rh, rw), (2 * rh - 1) * (2 * rw - 1))

    def _local_bias(self, hw):
        """``(heads, h*w, h*w)`` local bias of an ``hw`` map: the table as built for
        ``rpb_size``, or resized to the map's offset grid."""
        if hw == self.rpb_size:
            table, index = self.local_relative_position_bias_table, self.relative_position_index
        else:
            rh, rw = self.rpb_size
            table = resize_rpb_grid(
                self.local_relative_position_bias_table, (2 * rh - 1, 2 * rw - 1), (2 * hw[0] - 1, 2 * hw[1] - 1)
            )
            index = cached_full_attention_rpb_index(*hw, table.device)
        return table[index].permute(2, 0, 1)

    def forward(self, x, hw):
        """x: (B, G + H*W, C) with the global tokens first; hw: (H, W)."""
        b, n, c = x.shape
        g, heads = self.num_global, self.num_heads
        bias = None
        if self.use_rpb:
            bias = self._local_bias(tuple(hw))  # (heads, N_loc, N_loc)
            if g:
                num_local = n - g
                l2g = self.g2l_relative_position_bias[1][:, None, :].expand(heads, num_local, g)
                bias = torch.cat(
                    [
                        _global_token_bias(self.g2l_relative_position_bias, self.g2g_relative_position_bias, num_local),
                        torch.cat([l2g, bias], dim=-1),
                    ],
                    dim=1,
                )
        q, k, v = _split_heads(self.qkv(x), 3, heads)
        out = dense_attention(q * self.scale, k, v, bias=bias, dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, c)))


class LongShortAttention(ViLAttentionBase):
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
        window (int): Segment size ``w`` (7 at 224, 8 at 384). Default: 7.
        dp_rank (int): Rank ``r`` of the dynamic projection. Default: 8.
        attn_impl (str): The attention's path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.
        **kwargs: ``num_global``, ``qkv_bias``, ``use_rpb`` (the window RPB: a table of
            ``2(w+p-1)(2p+w+1)+1`` rows per head, indexed with the official aliasing),
            ``attn_drop`` (on the local queries' attention probabilities), ``proj_drop``: see
            :class:`ViLAttentionBase`.
    """

    def __init__(self, dim, num_heads, window=7, dp_rank=8, attn_impl='auto', **kwargs):
        super().__init__(dim, num_heads, **kwargs)
        self.window = window
        self.attn_impl = attn_impl
        self.to_dynamic_projection = nn.Linear(dim, dp_rank * num_heads)
        self.dual_ln_dp = nn.LayerNorm(dim, eps=DUAL_LN_EPS)
        self.dual_ln_full = nn.LayerNorm(dim, eps=DUAL_LN_EPS)
        # Global tokens have no biases here: the official long-short layer has none.
        self._init_bias_tables(long_short_rpb_index(window), long_short_rpb_table_size(window), global_biases=False)

    def _project(self, weights, kv):
        """``K_bar`` and ``V_bar``: ``P k`` and ``P v`` per head, then ``dual_ln_dp`` over all channels.

        One product of ``P``'s rows of every head with the channels of every head reads the
        local keys and values where they are (no per-head copy of them, which a product
        per head needs); the blocks of matching heads are kept.

        Args:
            weights (Tensor): ``P``, ``(B, heads, r, N)``.
            kv (Tensor): ``(B, N, 2, C)`` local keys and values, heads-last.

        Returns:
            tuple[Tensor, Tensor]: ``K_bar`` and ``V_bar``, ``(B, heads, r, d)`` each.
        """
        b, heads, rank, n = weights.shape
        products = weights.to(kv.dtype).reshape(b, heads * rank, n) @ kv.reshape(b, n, -1)
        products = products.reshape(b, heads, rank, 2, heads, -1).diagonal(dim1=1, dim2=4)  # (B, r, 2, d, heads)
        merged = self.dual_ln_dp(products.permute(0, 1, 2, 4, 3).reshape(b, rank, 2, -1))
        return tuple(merged[:, :, i].reshape(b, rank, heads, -1).transpose(1, 2) for i in range(2))

    def _dual_ln_full(self, kv):
        """``dual_ln_full`` of the keys and values, ``(B, n, 2, C)``, in one call.

        Under autocast their low-precision input is normalised as it is (the kernels
        accumulate in float32) into a low-precision output, which is all that its users,
        the autocast matrix products and fused attention, read: autocast's float32
        layer norm would keep a float32 copy for backward and a float32 output, each
        twice the size, to be cast back. Its weight and bias are cast too: CUDA's kernel
        takes them only in the input's dtype.
        """
        device = kv.device.type
        if torch.is_autocast_enabled(device) and kv.dtype == torch.get_autocast_dtype(device):
            norm = self.dual_ln_full
            with torch.autocast(device, enabled=False):
                weight, bias = norm.weight.to(kv.dtype), norm.bias.to(kv.dtype)
                return F.layer_norm(kv, norm.normalized_shape, weight, bias, norm.eps)
        return self.dual_ln_full(kv)

    def forward(self, x, hw):
        """x: (B, G + H*W, C) with the global tokens first; hw: (H, W)."""
        b, n, c = x.shape
        g, heads = self.num_global, self.num_heads
        device = x.device.type
        if torch.is_autocast_enabled(device):
            # Cast once for both products of x below (autocast would cast it once per product).
            x = x.to(torch.get_autocast_dtype(device))
        # Split, not sliced: backward joins the parts' gradients in one copy (slices' and
        # selections' gradients are zero-filled full-size tensors, then added).
        q, kv = self.qkv(x).split([c, 2 * c], dim=-1)
        kv = self._dual_ln_full(kv.unflatten(-1, (2, c)))  # (B, n, 2, C)
        (q,) = _split_heads(q * self.scale, 1, heads)
        k, v = _split_heads(kv, 2, heads)
        # The projection's logits of every token, global ones dropped after the product (a
        # slice of its small output, not a copy of x's local tokens).
        weights = dynamic_projection(self.to_dynamic_projection(x)[:, g:], heads)
        local_bias = None
        if self.use_rpb:
            local_bias = self.local_relative_position_bias_table[self.relative_position_index]
            local_bias = local_bias.permute(2, 0, 1)  # (heads, w*w, (w+2p)^2)
        k_bar, v_bar = self._project(weights, kv[:, g:])
        out = long_short_attention(
            q,
            k,
            v,
            *hw,
            self.window,
            k_bar=k_bar,
            v_bar=v_bar,
            local_bias=local_bias,
            dropout_p=self.attn_drop if self.training else 0.0,
            impl=self.attn_impl,
            leading_global=g,
        )
        glob = None
        if g:
            glob = dense_attention(
                q[:, :, :g], torch.cat([k[:, :, :g], out], dim=2), torch.cat([v[:, :, :g], out], dim=2)
            )
        return self.proj_drop(self.proj(_merge_heads(glob, out, (b, n, c))))
