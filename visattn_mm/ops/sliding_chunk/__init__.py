"""ViL sliding-chunk attention: local chunks + their neighbours + global tokens.

The map is zero-padded at the bottom/right to multiples of the chunk size ``w``
and cut into ``w x w`` chunks. Every query attends, in one softmax, to all global
tokens and to the keys of its own chunk and of the neighbour chunks that the
random-shift mode selects (all 8 by default). Keys are gathered chunk-wise, so
memory is ``O(N * 9 w^2)``, never ``O(N^2)``; the fused path (see
:mod:`visattn_mm.ops.impl`) also leaves the ``w^2 x 9 w^2`` scores per chunk
unstored when no bias needs a gradient.

Masking modes (which keys outside the image are hidden):
  * ``0``  -- neighbour chunks outside the chunk grid and padded positions.
  * ``-1`` -- cyclic: neighbours wrap around the grid; padded positions are masked
    wherever they are reached. (The official mask misses padded keys reached
    through the wrap; we mask them.) Grids with fewer than 3 chunks per axis reach
    the same chunk through several offsets; like the official code, such keys then
    enter the softmax once per offset.
  * ``1``  -- exact conv-like window: keys within ``+-w`` rows and columns of the
    query, clipped to the image. Only with shift mode 0.

Shift modes: ``0`` all 8 neighbours; ``-1`` own chunk only; ``k`` in 1..8 own
chunk plus neighbour ``k`` (the 8 non-centre entries of ``NEIGHBOUR_OFFSETS`` in order).
"""

import torch
import torch.nn.functional as F

from ..chunk_gather import chunked_fused_attention
from ..common import chunk_grid, device_cache, from_chunks, run_window_backend, softmax_fp32, to_chunks
from ..impl import attention_path
from ..indexing import NEIGHBOUR_OFFSETS, check_modes, neighbour_blocks


def wrap_once(index, size):
    """``index % size`` for indices in ``[-size, 2 * size)`` (the neighbours of a chunk).

    Written with comparisons: the ONNX exporter cannot take a remainder by a dynamic size.
    """
    return torch.where(index < 0, index + size, torch.where(index >= size, index - size, index))


def neighbour_key_coords(height, width, window, shift_mode):
    """Where the gathered keys of every chunk lie in the padded map (CPU tensors).

    Keys are the shift mode's neighbour chunks of each query chunk, wrapped around
    the ``R x C`` chunk grid.

    Returns:
        tuple[Tensor, Tensor, Tensor]: ``key_y``, ``key_x``: ``(R, C, nb, w, w)`` absolute
        row and column of each key; ``in_grid``: ``(R, C, nb)``, whether the neighbour
        chunk lies in the grid without wrapping.
    """
    w = window
    rows, cols = chunk_grid(height, width, w)
    blocks = neighbour_blocks(shift_mode)
    dy = torch.tensor([NEIGHBOUR_OFFSETS[b][0] for b in blocks])
    dx = torch.tensor([NEIGHBOUR_OFFSETS[b][1] for b in blocks])
    r = torch.arange(rows)[:, None, None]
    c = torch.arange(cols)[None, :, None]
    raw_r, raw_c = r + dy, c + dx  # (R, C, nb), unwrapped
    in_grid = (raw_r >= 0) & (raw_r < rows) & (raw_c >= 0) & (raw_c < cols)
    inner = torch.arange(w)
    key_y = (wrap_once(raw_r, rows) * w)[..., None, None] + inner[:, None]
    key_x = (wrap_once(raw_c, cols) * w)[..., None, None] + inner[None, :]
    return key_y, key_x, in_grid


def bias_of_blocks(local_bias, window, blocks):
    """The columns of a local bias ``(heads, w*w, 9*w*w)`` that reach the key chunks ``blocks``:
    ``(heads, w*w, len(blocks), w*w)``. Taken by slices: an index list would be copied to the GPU on
    every call, which makes the host wait for it."""
    chunk = window * window
    table = local_bias.reshape(local_bias.shape[0], chunk, 9, chunk)
    if len(blocks) == 9:
        return table
    return torch.stack([table[:, :, block] for block in blocks], dim=2)


@device_cache
def key_mask(height, width, window, masking_mode, shift_mode, device):
    """Which gathered keys are hidden from which queries (True = hidden).

    Keys are the shift mode's neighbour chunks of each query chunk, wrapped around
    the ``R x C`` chunk grid (see :func:`gather_neighbour_chunks`). Cached per shape
    and device: built once, vectorised, then reused.

    Returns:
        BoolTensor: ``(R*C, nb*w*w)`` for masking modes 0/-1 (the same for every
        query of a chunk), ``(R*C, w*w, nb*w*w)`` for mode 1.
    """
    w = window
    rows, cols = chunk_grid(height, width, w)
    key_y, key_x, in_grid = neighbour_key_coords(height, width, w, shift_mode)
    in_image = (key_y < height) & (key_x < width)
    if masking_mode == -1:
        return (~in_image).reshape(rows * cols, -1).to(device)
    hidden = (~in_image | ~in_grid[..., None, None]).reshape(rows * cols, -1).to(device)
    if masking_mode == 1:
        # Exact window: the outside-the-image keys of mode 0, plus keys beyond +-w.
        return hidden[:, None, :] | outside_exact_window(w, device)
    return hidden


@device_cache
def outside_exact_window(window, device):
    """Which of the 9 neighbour chunks' keys lie beyond ``+-w`` rows or columns of each query.

    The same for every chunk: query and key offsets are taken from the query
    chunk's corner, unwrapped (masking mode 1, shift mode 0).

    Returns:
        BoolTensor: ``(w*w, 9*w*w)``, True = hidden.
    """
    w = window
    inner = torch.arange(w)
    offsets = torch.tensor(NEIGHBOUR_OFFSETS)  # (9, 2)
    key_y = (offsets[:, 0, None, None] * w + inner[:, None]).expand(9, w, w).reshape(-1)
    key_x = (offsets[:, 1, None, None] * w + inner[None, :]).expand(9, w, w).reshape(-1)
    query_y, query_x = inner.repeat_interleave(w), inner.repeat(w)
    near = ((query_y[:, None] - key_y).abs() <= w) & ((query_x[:, None] - key_x).abs() <= w)
    return (~near).to(device)


def neighbour_chunk_views(chunks, blocks):
    """For every chunk, views of the keys of the given neighbour chunks.

    The grid is extended by one chunk on each side with the opposite edge
    (wrap-around); keys that masking mode 0 must not see there are hidden by
    :func:`key_mask`. Slicing the extended grid keeps the backward pass a cheap
    scatter of slices (an index-based gather backpropagates with a serial
    ``index_add``).

    Args:
        chunks (Tensor): ``(B, h, R, C, w*w, d)``.
        blocks (Sequence[int]): Indices into ``NEIGHBOUR_OFFSETS``.

    Returns:
        list[Tensor]: one ``(B, h, R, C, w*w, d)`` view per block.
    """
    rows, cols = chunks.shape[2:4]
    grid = torch.cat([chunks[:, :, -1:], chunks, chunks[:, :, :1]], dim=2)
    grid = torch.cat([grid[:, :, :, -1:], grid, grid[:, :, :, :1]], dim=3)
    return [
        grid[:, :, 1 + dy : 1 + dy + rows, 1 + dx : 1 + dx + cols] for dy, dx in (NEIGHBOUR_OFFSETS[b] for b in blocks)
    ]


def gather_neighbour_chunks(chunks, blocks):
    """Concatenate, for every chunk, the keys of the given neighbour chunks.

    Args:
        chunks (Tensor): ``(B, h, R, C, w*w, d)``.
        blocks (Sequence[int]): Indices into ``NEIGHBOUR_OFFSETS``.

    Returns:
        Tensor: ``(B, h, R, C, nb*w*w, d)``, see :func:`neighbour_chunk_views`.
    """
    parts = neighbour_chunk_views(chunks, blocks)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=4)


def sliding_chunk_attention(
    q,
    k,
    v,
    height,
    width,
    window,
    *,
    global_k=None,
    global_v=None,
    local_bias=None,
    l2g_bias=None,
    masking_mode=0,
    shift_mode=0,
    dropout_p=0.0,
    impl='auto',
    leading_global=0,
):
    """Local tokens attend to their neighbour chunks and to the global tokens.

    Args:
        q, k, v (Tensor): ``(B, heads, H*W, d)`` local queries (row-major, already scaled), keys and values.
        height, width (int): Map size ``H x W``.
        window (int): Chunk size ``w``.
        global_k, global_v (Tensor, optional): ``(B, heads, G, d)`` keys and values of the global tokens.
        local_bias (Tensor, optional): ``(heads, w*w, 9*w*w)`` RPB over all 9
            neighbour chunks; the columns of the shift mode are picked here.
        l2g_bias (Tensor, optional): ``(heads, G)`` bias of local->global logits.
        masking_mode (int): 0, -1 or 1, see the module docstring.
        shift_mode (int): 0, -1 or 1..8, see the module docstring.
        dropout_p (float): Dropout on the attention probabilities.
        impl (str): The path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.
        leading_global (int): ``q``, ``k`` and ``v`` begin with this many global tokens, whose
            keys and values are the global ones (``global_k`` and ``global_v`` must then be None;
            how each path takes them: :func:`~visattn_mm.ops.common.run_window_backend`). Default: 0.

    Returns:
        Tensor: ``(B, heads, H*W, d)``.
    """
    check_modes(masking_mode, shift_mode)
    path = attention_path('sliding_chunk', q, local_bias, l2g_bias, impl=impl, window=window, dropout_p=dropout_p)
    options = dict(
        local_bias=local_bias, l2g_bias=l2g_bias, masking_mode=masking_mode, shift_mode=shift_mode, dropout_p=dropout_p
    )
    return run_window_backend(
        _BACKENDS, path, q, k, v, (height, width, window), global_k, global_v, leading_global, options
    )


def _math_sliding_chunk_attention(
    q, k, v, height, width, window, *, global_k, global_v, local_bias, l2g_bias, masking_mode, shift_mode, dropout_p
):
    """:func:`sliding_chunk_attention` in plain tensor ops: every chunk's logits, masked, one softmax."""
    w = window
    hidden = key_mask(height, width, w, masking_mode, shift_mode, q.device)
    blocks = neighbour_blocks(shift_mode)
    q_chunks = to_chunks(q, height, width, w)
    b, heads, rows, cols, _, d = q_chunks.shape
    q_chunks = q_chunks.reshape(b, heads, rows * cols, w * w, d)

    def gather(t):
        t = gather_neighbour_chunks(to_chunks(t, height, width, w), blocks)
        return t.reshape(b, heads, rows * cols, len(blocks) * w * w, d)

    k_near, v_near = gather(k), gather(v)
    logits = q_chunks @ k_near.transpose(-1, -2)  # (B, h, R*C, w*w, nb*w*w)
    if local_bias is not None:
        logits = logits + bias_of_blocks(local_bias, w, blocks).reshape(heads, 1, w * w, -1)
    logits = logits.masked_fill(hidden[:, None, :] if hidden.dim() == 2 else hidden, float('-inf'))

    num_global = 0 if global_k is None else global_k.shape[2]
    if num_global:
        g_logits = q_chunks @ global_k.unsqueeze(2).transpose(-1, -2)  # (B, h, R*C, w*w, G)
        if l2g_bias is not None:
            g_logits = g_logits + l2g_bias[:, None, None, :]
        logits = torch.cat([g_logits, logits], dim=-1)

    attn = softmax_fp32(logits).to(v.dtype)
    if dropout_p > 0:
        attn = F.dropout(attn, p=dropout_p, training=True)
    out = attn[..., num_global:] @ v_near
    if num_global:
        out = out + attn[..., :num_global] @ global_v.unsqueeze(2)
    out = out.reshape(b, heads, rows, cols, w * w, d)
    return from_chunks(out, height, width, w)


def _fused_sliding_chunk_attention(
    q,
    k,
    v,
    height,
    width,
    window,
    *,
    global_k=None,
    global_v=None,
    leading_global=0,
    local_bias,
    l2g_bias,
    masking_mode,
    shift_mode,
    dropout_p,
):
    """:func:`sliding_chunk_attention` through :func:`~visattn_mm.ops.chunk_gather.chunked_fused_attention`.

    Per chunk, the keys are ``[global | neighbour]`` (:func:`neighbour_key_index`). Hidden
    keys (padding, neighbours beyond the grid) are the gather's extra row; the bias
    (RPB, local->global bias, exact window) is the same for every chunk. With
    ``leading_global`` tokens (see :func:`sliding_chunk_attention`) the global keys and
    values are the first rows of ``k`` and ``v``.
    """
    w = window
    blocks = neighbour_blocks(shift_mode)
    heads = q.shape[1]
    chunk = w * w
    num_global = leading_global or (0 if global_k is None else global_k.shape[2])

    bias = None
    if local_bias is not None or l2g_bias is not None or masking_mode == 1:
        bias = q.new_zeros(heads, chunk, len(blocks) * chunk)
        if local_bias is not None:
            bias = bias + bias_of_blocks(local_bias, w, blocks).flatten(2)
        if masking_mode == 1:
            bias = bias.masked_fill(outside_exact_window(w, q.device), float('-inf'))
        if num_global:
            to_global = q.new_zeros(heads, 1, num_global) if l2g_bias is None else l2g_bias[:, None, :]
            bias = torch.cat([to_global.expand(heads, chunk, num_global), bias], dim=-1)
    # Mode 1 = the key-only mask of mode 0 plus the chunk-independent window (in the bias).
    key_masking = 0 if masking_mode == 1 else masking_mode
    keys = (k,) if leading_global or not num_global else (global_k, k)
    values = (v,) if leading_global or not num_global else (global_v, v)
    kv_index = neighbour_key_index(height, width, w, key_masking, shift_mode, num_global, q.device)
    hidden = None
    if bias is None:
        hidden = F.pad(key_mask(height, width, w, key_masking, shift_mode, q.device), (num_global, 0))
    return chunked_fused_attention(q, keys, values, height, width, w, kv_index, bias, hidden, dropout_p, leading_global)


def _triton_sliding_chunk_attention(*args, **options):
    from .triton import triton_sliding_chunk_attention  # Triton is optional: imported when used

    return triton_sliding_chunk_attention(*args, **options)


_BACKENDS = dict(
    math=_math_sliding_chunk_attention, fast=_fused_sliding_chunk_attention, triton=_triton_sliding_chunk_attention
)


@device_cache
def neighbour_key_index(height, width, window, masking_mode, shift_mode, num_global, device):
    """Which token each gathered key is, for :class:`~visattn_mm.ops.chunk_gather.ChunkGather`.

    Per chunk: the ``G`` global tokens (rows ``0..G-1``), then the shift mode's
    neighbour chunks as :func:`key_mask` orders them (local token ``y * W + x`` at row
    ``G + y * W + x``); keys that :func:`key_mask` hides point to the extra row
    ``G + H * W``.

    Returns:
        LongTensor: ``(R*C*(G + nb*w*w),)``.
    """
    rows, cols = chunk_grid(height, width, window)
    key_y, key_x, _ = neighbour_key_coords(height, width, window, shift_mode)
    local = num_global + key_y * width + key_x
    hidden = key_mask(height, width, window, masking_mode, shift_mode, torch.device('cpu'))
    local = torch.where(hidden, num_global + height * width, local.reshape(hidden.shape))
    glob = torch.arange(num_global).expand(rows * cols, num_global)
    return torch.cat([glob, local], dim=1).reshape(-1).to(device)
