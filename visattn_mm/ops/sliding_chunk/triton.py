"""Sliding-chunk attention as Triton kernels (``impl='triton'``), forward and backward.

The same function as :func:`visattn_mm.ops.sliding_chunk.sliding_chunk_attention`
(see there for the masking and shift modes), computed without gathering
neighbours or storing logits. One program handles one ``w x w`` chunk of one
(batch, head) pair; chunk slot ``s`` is the token ``(s // w, s % w)`` of the
chunk, so the zero padding of the map is never materialised: padded slots are
masked loads.

* Forward: online softmax (FlashAttention style) over the global keys and the
  shift mode's neighbour chunks of the query chunk; the masks (outside the
  image, outside the chunk grid, the exact window of masking mode 1) are
  computed from chunk coordinates. Saves one log-sum-exp per query.
* Backward (FlashAttention-2 style, probabilities recomputed from the
  log-sum-exp): a query-centric kernel writes the gradient of the queries,
  per-chunk partial gradients of the global keys / values / local->global bias
  (summed afterwards) and adds the gradient of the local bias with atomics; a
  key-centric kernel then loops over the query chunks that see its key chunk
  and writes the gradients of the local keys and values.

Numerics and dtypes: see :mod:`visattn_mm.ops.triton.kernel_parts`; the interpreter:
see :mod:`visattn_mm.ops.triton`. The gradient of the local bias is summed with
atomics over all chunks and the batch, so its last bits may vary from run to run;
the programs spread their adds over copies of it
(:func:`~visattn_mm.ops.triton.kernel_parts.add_bias_grad`), since atomics on one
address serialise. Under ``torch.use_deterministic_algorithms`` (mmengine's
``randomness.deterministic``) a third backward kernel sums it instead, without
atomics, in the same order on every run (:func:`~visattn_mm.ops.triton.host.bias_grad_parts`).

Dropout is not supported: ``dropout_p > 0`` raises a ValueError (choose
``impl='fast'`` or ``'math'`` for attention dropout).

One tile covers a chunk (``next_pow2(w*w)`` slots, 64 for the default ``w = 7``);
windows over 11 are refused: tiles of 256 slots do not fit the shared memory of a GPU.
With :data:`PACK_KEY_TILES` (off until a GPU has timed it) the forward and the query-side
backward kernel read the 9 neighbour chunks' keys packed instead: ``9 * w*w`` keys in
block-major order fill ``ceil(9 * w*w / BLOCK)`` tiles (441 keys in 7 tiles of 64 for ``w = 7``,
where one tile per chunk takes 9), each key computing its own chunk, mask and bias column; the
key-side backward packs the queries of the 9 chunks that see its keys alike. Per chunk the tile
products drop from 18 to 14 (forward) and from 63 to 49 (backward: 3 and 4 per tile).
"""

from typing import NamedTuple, Optional  # noqa: I001 (visattn_mm.ops.triton first)

# First, before `import triton`: importing the shared package visattn_mm.ops.triton names the fix where
# triton does not import.
from ..triton import host, kernel_parts as kp

import torch
import triton
import triton.language as tl

from ..common import chunk_grid
from ..indexing import check_modes, neighbour_blocks

__all__ = ['triton_sliding_chunk_attention']

# Whether the kernels loop over packed tiles: the forward and the query-side backward over the 9 neighbour
# chunks' keys in ceil(9 * w*w / BLOCK) tiles (7 of 64 slots for 441 keys at w = 7) instead of one 64-slot tile
# per 49-key chunk (9 tiles), the key-side backward likewise over the queries of the 9 chunks that see its keys:
# fewer tile products, more index arithmetic per key or query. Off until a GPU has passed the CUDA tests with it
# and timed it (tools/analysis/triton_tuning.py times it); turning it on changes the kernels' compiled code
# (triton_resources.py --digests write). Shift modes with 2 blocks keep their 2 tiles.
PACK_KEY_TILES = False
PACKED_KEY_KERNELS = ('_sliding_chunk_forward', '_sliding_chunk_backward_queries', '_sliding_chunk_backward_keys')


class _Tile(NamedTuple):
    """The compile-time constants every sliding-chunk kernel and its helpers read, as one ``tile``
    argument (one place to add one).

    Args:
        WINDOW (int): The chunk size ``w``.
        MASKING_MODE (int): 0, -1 or 1 (see :mod:`visattn_mm.ops.sliding_chunk`).
        NUM_BLOCKS (int): Neighbour chunks of the shift mode: 9, or 2 (the own chunk and ``SECOND_BLOCK``).
        SECOND_BLOCK (int): The last neighbour block of the shift mode.
        HAS_LOCAL_BIAS (bool): Whether there is a local bias.
        PACKED_KEYS (bool): Whether the forward and the query-side backward kernel read the neighbour chunks'
            keys packed (:data:`PACK_KEY_TILES`): tile ``t`` holds keys ``t * BLOCK`` to ``(t + 1) * BLOCK - 1``
            of the ``9 * w*w`` in block-major order, the order of the local bias's columns.
        KEY_TILES (int): Key tiles of those two kernels' loop over the neighbour chunks: ``NUM_BLOCKS``, or
            ``ceil(9 * w*w / BLOCK)`` packed (7 for ``w = 7``).
        BLOCK (int): Token slots of a tile (:func:`~visattn_mm.ops.triton.host.tile` of ``w*w``).
        BLOCK_D (int): Head-dim slots of a tile.
        DOT_PRECISION (str): ``tl.dot``'s input precision (:func:`~visattn_mm.ops.triton.host.dot_precision`).
    """

    WINDOW: int
    MASKING_MODE: int
    NUM_BLOCKS: int
    SECOND_BLOCK: int
    HAS_LOCAL_BIAS: bool
    PACKED_KEYS: bool
    KEY_TILES: int
    BLOCK: int
    BLOCK_D: int
    DOT_PRECISION: str


class _Inputs(NamedTuple):
    """The op's tensor inputs (the custom op's leading arguments; ``host.define_op``)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    global_k: Optional[torch.Tensor]
    global_v: Optional[torch.Tensor]
    local_bias: Optional[torch.Tensor]
    l2g_bias: Optional[torch.Tensor]


class _Shared(NamedTuple):
    """The compile-time constants of the shared keys, which the forward and the query-side backward kernel
    read, as one ``shared`` argument.

    Args:
        GLOBAL (SharedKeys): The ``G`` global keys (:class:`~visattn_mm.ops.triton.host.SharedKeys`;
            their bias: the local->global one).
    """

    GLOBAL: host.SharedKeys


@triton.jit
def _neighbour_block(step, tile):
    """Index into ``NEIGHBOUR_OFFSETS`` of the ``step``-th key chunk of the shift mode.

    All 9 blocks in order, or the own chunk (4) followed by ``SECOND_BLOCK``.
    """
    block = step
    if tile.NUM_BLOCKS != 9:
        block = 4 + (tile.SECOND_BLOCK - 4) * step
    return block


@triton.jit
def _neighbour_chunk(chunk_row, chunk_col, block, rows, cols):
    """The key chunk that ``block`` reaches from a query chunk, wrapped around the grid, and
    whether it lies inside the grid unwrapped (``NEIGHBOUR_OFFSETS[b] = (b // 3 - 1, b % 3 - 1)``)."""
    raw_row = chunk_row + block // 3 - 1
    raw_col = chunk_col + block % 3 - 1
    in_grid = (raw_row >= 0) & (raw_row < rows) & (raw_col >= 0) & (raw_col < cols)
    return (raw_row + rows) % rows, (raw_col + cols) % cols, in_grid


@triton.jit
def _mask_local_scores(scores, query_slots, key_slots, key_valid, local_bias, head, block, in_grid, tile: tl.constexpr):
    """Adds the local bias (a :class:`~visattn_mm.ops.triton.host.BiasTable`) to the dot products of a
    query chunk and one neighbour chunk, and sets hidden logits to ``-inf``.

    Works on either orientation: ``query_slots``, ``key_slots`` and ``key_valid``
    are broadcast along the tile's query and key axes (``[:, None]`` and
    ``[None, :]`` for ``(queries, keys)`` tiles, the reverse for transposed ones).

    Returns:
        The logits and the visibility mask (which broadcasts against them; it
        depends on the key only in masking modes 0 / -1).
    """
    if tile.HAS_LOCAL_BIAS:
        in_chunk = (query_slots < tile.WINDOW * tile.WINDOW) & (key_slots < tile.WINDOW * tile.WINDOW)
        # The key's column in the gathered bias: the key order of rel_pos.sliding_chunk_rpb_index.
        base = local_bias.ptr + head * local_bias.head
        pointers = (
            base + query_slots * local_bias.query + (block * tile.WINDOW * tile.WINDOW + key_slots) * local_bias.key
        )
        scores += tl.load(pointers, mask=in_chunk, other=0.0).to(scores.dtype)
    visible = key_valid
    if tile.MASKING_MODE != -1:
        visible = visible & in_grid
    if tile.MASKING_MODE == 1:
        # Exact window (as sliding_chunk.outside_exact_window): query and key offsets from the query
        # chunk's corner differ by at most w.
        rel_y = query_slots // tile.WINDOW - ((block // 3 - 1) * tile.WINDOW + key_slots // tile.WINDOW)
        rel_x = query_slots % tile.WINDOW - ((block % 3 - 1) * tile.WINDOW + key_slots % tile.WINDOW)
        visible = visible & (tl.abs(rel_y) <= tile.WINDOW) & (tl.abs(rel_x) <= tile.WINDOW)
    return tl.where(visible, scores, float('-inf')), visible


@triton.jit
def _packed_slots(step, tile: tl.constexpr):
    """The ``step``-th packed tile (see :class:`_Tile`): each slot's place among the 9 chunks' ``w*w`` tokens in
    block-major order (a key's column in the local bias), its block and its slot in that chunk.

    The last tile's slots past the 9 chunks stay in block 8 with chunk slots past ``w*w``: no bias is read for
    them and :func:`_packed_tokens` marks them invalid.
    """
    index = step * tile.BLOCK + tl.arange(0, tile.BLOCK)
    block = tl.minimum(index // (tile.WINDOW * tile.WINDOW), 8)
    return index, block, index - block * tile.WINDOW * tile.WINDOW


@triton.jit
def _packed_tokens(chunk_row, chunk_col, index, chunk_slots, height, width, tile: tl.constexpr):
    """Row-major token of each slot of a packed tile (:func:`_packed_slots`; each slot's chunk given), and
    whether it is a token of the map (:func:`~visattn_mm.ops.triton.kernel_parts.chunk_tokens`, slot by slot)."""
    y = chunk_row * tile.WINDOW + chunk_slots // tile.WINDOW
    x = chunk_col * tile.WINDOW + chunk_slots % tile.WINDOW
    valid = (index < 9 * tile.WINDOW * tile.WINDOW) & (y < height) & (x < width)
    return y * width + x, valid


@triton.jit
def _neighbour_tile(
    queries, step, k, v, local_bias, batch, head, row, col, geometry, tile: tl.constexpr, PACKED: tl.constexpr
):
    """The ``step``-th key tile against the query chunk at ``(row, col)``: the loop body of the forward and the
    query-side backward kernel. Unpacked, the ``step``-th key chunk of the shift mode; ``PACKED``, keys
    ``step * BLOCK`` onwards of the 9 neighbour chunks' ``w*w`` in block-major order (see :class:`_Tile`),
    so that a tile may span two chunks and each key has its own block.

    Returns:
        The keys' columns in the local bias (``block * w*w + slot``), the visibility mask (see
        :func:`_mask_local_scores`), the keys and values, and the ``(queries, keys)`` tile of logits.
    """
    _, height, width, rows, cols, head_dim = geometry
    slots = tl.arange(0, tile.BLOCK)
    if PACKED:
        columns, block, key_slots = _packed_slots(step, tile)
        key_row, key_col, in_grid = _neighbour_chunk(row, col, block, rows, cols)
        key_tokens, key_valid = _packed_tokens(key_row, key_col, columns, key_slots, height, width, tile)
        keys, values, scores = kp.key_tile(
            queries, k, v, batch, head, key_tokens, key_valid, head_dim, tile.BLOCK_D, tile.DOT_PRECISION
        )
        scores, visible = _mask_local_scores(
            scores,
            slots[:, None],
            key_slots[None, :],
            key_valid[None, :],
            local_bias,
            head,
            block[None, :],
            in_grid[None, :],
            tile,
        )
    else:
        block = _neighbour_block(step, tile)
        key_row, key_col, in_grid = _neighbour_chunk(row, col, block, rows, cols)
        key_tokens, key_valid = kp.chunk_tokens(key_row, key_col, height, width, tile.WINDOW, tile.BLOCK)
        keys, values, scores = kp.key_tile(
            queries, k, v, batch, head, key_tokens, key_valid, head_dim, tile.BLOCK_D, tile.DOT_PRECISION
        )
        scores, visible = _mask_local_scores(
            scores, slots[:, None], slots[None, :], key_valid[None, :], local_bias, head, block, in_grid, tile
        )
        columns = block * tile.WINDOW * tile.WINDOW + slots
    return columns, visible, keys, values, scores


@triton.jit
def _sliding_chunk_forward(inputs, out, lse, geometry, tile: tl.constexpr, shared: tl.constexpr):
    """Output and log-sum-exp of one query chunk; grid ``(rows * cols, batch * heads)``."""
    q, k, v, global_k, global_v, local_bias, l2g_bias = inputs
    heads, height, width, rows, cols, head_dim = geometry
    chunk, batch_head, batch, head, row, col = kp.program_chunk(heads, cols)
    tokens, query_valid = kp.chunk_tokens(row, col, height, width, tile.WINDOW, tile.BLOCK)
    queries = kp.load_rows(q, batch, head, tokens, query_valid, head_dim, tile.BLOCK_D)

    row_max, row_sum, acc = kp.softmax_start(lse, tile.BLOCK, tile.BLOCK_D)
    if shared.GLOBAL.NUM > 0:
        global_set = (global_k, global_v, l2g_bias)
        row_max, row_sum, acc = kp.shared_keys_forward(
            row_max, row_sum, acc, queries, global_set, batch, head, head_dim, shared.GLOBAL, tile
        )

    for step in range(tile.KEY_TILES):
        _, _, _, values, scores = _neighbour_tile(
            queries, step, k, v, local_bias, batch, head, row, col, geometry, tile, tile.PACKED_KEYS
        )
        row_max, row_sum, acc = kp.softmax_step(row_max, row_sum, acc, scores, values, tile.DOT_PRECISION)

    lse_row = lse + batch_head * height * width
    kp.finish_forward(out, batch, head, lse_row, tokens, query_valid, head_dim, row_max, row_sum, acc, tile.BLOCK_D)


@triton.jit
def _sliding_chunk_backward_queries(
    inputs,
    out,
    grad_out,
    lse,
    delta,
    grad_q,
    grad_local_bias,
    shared_grads,
    geometry,
    bias_copies,
    tile: tl.constexpr,
    shared: tl.constexpr,
    LOCAL_BIAS_GRAD: tl.constexpr,
):
    """Gradients seen from one query chunk; grid ``(rows * cols, batch * heads)``.

    Writes ``delta = rowsum(dO * O)`` of the chunk's queries (read by
    :func:`_sliding_chunk_backward_keys`), their gradient, this chunk's partial
    sums of the global gradients (``grad_global_k / grad_global_v``:
    ``(batch * heads * rows * cols, G, head_dim)``, ``grad_l2g``:
    ``(batch * heads * rows * cols, G)``), and adds its logit gradients
    to ``grad_local_bias`` (``(bias_copies, heads, w*w, 9*w*w)``, contiguous).
    """
    q, k, v, global_k, global_v, local_bias, l2g_bias = inputs
    heads, height, width, rows, cols, head_dim = geometry
    chunk, batch_head, batch, head, row, col = kp.program_chunk(heads, cols)
    tokens, query_valid = kp.chunk_tokens(row, col, height, width, tile.WINDOW, tile.BLOCK)
    lse_row, delta_row = lse + batch_head * height * width, delta + batch_head * height * width
    query_rows = kp.backward_rows(
        q, grad_out, out, batch, head, lse_row, delta_row, tokens, query_valid, head_dim, tile.BLOCK_D
    )
    queries = query_rows[0]
    grad_queries = kp.accumulator(lse, tile.BLOCK, tile.BLOCK_D)

    if shared.GLOBAL.NUM > 0:
        global_set = (global_k, global_v, l2g_bias)
        part = batch_head * rows * cols + chunk
        grad_queries += kp.shared_keys_backward(
            query_rows, global_set, shared_grads, part, batch, head, head_dim, shared.GLOBAL, tile
        )

    slots = tl.arange(0, tile.BLOCK)
    for step in range(tile.KEY_TILES):
        columns, visible, keys, values, scores = _neighbour_tile(
            queries, step, k, v, local_bias, batch, head, row, col, geometry, tile, tile.PACKED_KEYS
        )
        _, grad_scores = kp.logit_grads(scores, query_rows, values, tile.DOT_PRECISION)
        grad_queries += tl.dot(grad_scores.to(keys.dtype), keys, input_precision=tile.DOT_PRECISION)
        if LOCAL_BIAS_GRAD:
            kp.add_bias_grad(
                grad_local_bias,
                bias_copies,
                heads,
                head,
                slots,
                columns,
                grad_scores,
                query_valid[:, None] & visible,
                tile.WINDOW * tile.WINDOW,
                9 * tile.WINDOW * tile.WINDOW,
            )

    kp.store_rows(grad_q, batch, head, tokens, query_valid, head_dim, grad_queries, tile.BLOCK_D)


@triton.jit
def _sliding_chunk_backward_keys(
    q, k, v, local_bias, grad_out, lse, delta, grad_k, grad_v, geometry, tile: tl.constexpr
):
    """Gradients of one key chunk's keys and values; grid ``(rows * cols, batch * heads)``.

    A key chunk is block ``b`` of exactly one query chunk per ``b`` (the offset
    taken back, wrapped), so this loops over the same (query chunk, block)
    pairs as the forward pass.
    """
    heads, height, width, rows, cols, head_dim = geometry
    chunk, batch_head, batch, head, key_row, key_col = kp.program_chunk(heads, cols)
    key_tokens, key_valid = kp.chunk_tokens(key_row, key_col, height, width, tile.WINDOW, tile.BLOCK)
    keys, values = kp.key_value_rows(k, v, batch, head, key_tokens, key_valid, head_dim, tile.BLOCK_D)
    grad_keys, grad_values = (
        kp.accumulator(lse, tile.BLOCK, tile.BLOCK_D),
        kp.accumulator(lse, tile.BLOCK, tile.BLOCK_D),
    )

    slots = tl.arange(0, tile.BLOCK)
    lse_row, delta_row = lse + batch_head * height * width, delta + batch_head * height * width
    for step in range(tile.KEY_TILES):
        if tile.PACKED_KEYS:
            # The 9 query chunks that see this key chunk, their w*w queries in block-major order (the order of
            # the forward's packed keys), BLOCK of them a tile: each query has its own chunk and block.
            index, block, query_slots = _packed_slots(step, tile)
            row = (key_row - (block // 3 - 1) + rows) % rows
            col = (key_col - (block % 3 - 1) + cols) % cols
            _, _, in_grid = _neighbour_chunk(row, col, block, rows, cols)
            tokens, query_valid = _packed_tokens(row, col, index, query_slots, height, width, tile)
        else:
            block = _neighbour_block(step, tile)
            row = (key_row - (block // 3 - 1) + rows) % rows
            col = (key_col - (block % 3 - 1) + cols) % cols
            _, _, in_grid = _neighbour_chunk(row, col, block, rows, cols)
            tokens, query_valid = kp.chunk_tokens(row, col, height, width, tile.WINDOW, tile.BLOCK)
        query_rows, scores = kp.query_tile(
            keys,
            q,
            grad_out,
            batch,
            head,
            lse_row,
            delta_row,
            tokens,
            query_valid,
            head_dim,
            tile.BLOCK_D,
            tile.DOT_PRECISION,
        )
        if tile.PACKED_KEYS:
            scores, _ = _mask_local_scores(
                scores,
                query_slots[None, :],
                slots[:, None],
                key_valid[:, None],
                local_bias,
                head,
                block[None, :],
                in_grid[None, :],
                tile,
            )
        else:
            scores, _ = _mask_local_scores(
                scores, slots[None, :], slots[:, None], key_valid[:, None], local_bias, head, block, in_grid, tile
            )
        grad_keys, grad_values = kp.key_grads_step(
            grad_keys, grad_values, scores, values, query_rows, tile.DOT_PRECISION
        )

    kp.store_key_grads(
        grad_k, grad_v, batch, head, key_tokens, key_valid, head_dim, grad_keys, grad_values, tile.BLOCK_D
    )


@triton.jit
def _sliding_chunk_bias_grad(inputs, grad_out, lse, delta, grad_parts, geometry, chunks, pairs, tile: tl.constexpr):
    """The local-bias gradient without atomics: one neighbour step of one head, summed over every
    ``parts``-th of the ``pairs`` (batch, query chunk) pairs
    (:func:`~visattn_mm.ops.triton.kernel_parts.store_bias_grad_part`); grid ``(NUM_BLOCKS, heads, parts)``,
    after the query-side kernel (which writes ``delta``)."""
    # No `_` before the loop: Triton would take it for a variable the loop carries.
    q, k, v, local_bias = inputs[0], inputs[1], inputs[2], inputs[5]
    heads, height, width, cols, head_dim = geometry[0], geometry[1], geometry[2], geometry[4], geometry[5]
    step, head = tl.program_id(0), tl.program_id(1)
    block = _neighbour_block(step, tile)
    slots = tl.arange(0, tile.BLOCK)
    grad_sum = tl.zeros([tile.BLOCK, tile.BLOCK], lse.dtype.element_ty)
    for index in range(tl.program_id(2), pairs, tl.num_programs(2)):
        batch, row, col, query_rows = kp.bias_grad_chunk(
            index, chunks, q, grad_out, lse, delta, (heads, height, width, cols, head_dim), head, tile
        )
        _, visible, _, values, scores = _neighbour_tile(
            query_rows[0], step, k, v, local_bias, batch, head, row, col, geometry, tile, False
        )
        _, grad_scores = kp.logit_grads(scores, query_rows, values, tile.DOT_PRECISION)
        grad_sum += tl.where(query_rows[4][:, None] & visible, grad_scores, 0.0)
    chunk = tile.WINDOW * tile.WINDOW
    in_chunk = (slots[:, None] < chunk) & (slots[None, :] < chunk)
    kp.store_bias_grad_part(grad_parts, heads, head, slots, block * chunk + slots, grad_sum, in_chunk, chunk, 9 * chunk)


def _launch_setup(q, global_k, local_bias, l2g_bias, height, width, window, masking_mode, shift_mode):
    """The kernels' :class:`~visattn_mm.ops.triton.host.LaunchPlan`."""
    batch, heads, _, head_dim = q.shape
    rows, cols = chunk_grid(height, width, window)
    blocks = neighbour_blocks(shift_mode)
    num_global = 0 if global_k is None else global_k.shape[2]
    block = host.tile(window * window)
    packed = PACK_KEY_TILES and len(blocks) == 9
    tile = _Tile(
        WINDOW=window,
        MASKING_MODE=masking_mode,
        NUM_BLOCKS=len(blocks),
        SECOND_BLOCK=blocks[-1],
        HAS_LOCAL_BIAS=local_bias is not None,
        PACKED_KEYS=packed,
        KEY_TILES=triton.cdiv(9 * window * window, block) if packed else len(blocks),
        BLOCK=block,
        BLOCK_D=host.tile(head_dim),
        DOT_PRECISION=host.dot_precision(q.dtype),
    )
    shared = _Shared(GLOBAL=host.shared_key_constants(num_global, has_bias=l2g_bias is not None))
    return host.LaunchPlan(
        (rows * cols, batch * heads),
        (heads, height, width, rows, cols, head_dim),
        host.constant_bundle(tile),
        host.constant_bundle(shared),
        host.launch_settings(q.dtype),
        key_tiles=len(blocks),
    )


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    global_k: Optional[torch.Tensor],
    global_v: Optional[torch.Tensor],
    local_bias: Optional[torch.Tensor],
    l2g_bias: Optional[torch.Tensor],
    height: int,
    width: int,
    window: int,
    masking_mode: int,
    shift_mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and the log-sum-exp of each query's logits, ``(B * heads, H * W)``."""
    plan = _launch_setup(q, global_k, local_bias, l2g_bias, height, width, window, masking_mode, shift_mode)
    return host.window_softmax_forward(
        _KERNELS, plan, q, _input_args(q, k, v, global_k, global_v, local_bias, l2g_bias)
    )


def _input_args(q, k, v, global_k, global_v, local_bias, l2g_bias):
    """The op's tensor inputs as the forward and the query-side backward kernel take them (an :class:`_Inputs`)."""
    return _Inputs(
        *map(host.head_rows, (q, k, v)),
        host.head_rows(global_k, q),
        host.head_rows(global_v, q),
        host.bias_table(local_bias, q),
        host.bias_table(l2g_bias, q),
    )


def _backward(
    grad_out,
    q,
    k,
    v,
    global_k,
    global_v,
    local_bias,
    l2g_bias,
    out,
    lse,
    height,
    width,
    window,
    masking_mode,
    shift_mode,
    needs_grad,
):
    """The gradients of ``q, k, v, global_k, global_v, local_bias, l2g_bias``."""
    inputs = _Inputs(q, k, v, global_k, global_v, local_bias, l2g_bias)
    plan = _launch_setup(q, global_k, local_bias, l2g_bias, height, width, window, masking_mode, shift_mode)
    grad_global_k, grad_global_v, grad_l2g = host.shared_key_parts(
        lse, plan.programs, global_k, with_bias=l2g_bias is not None
    )
    grad_q, grad_k, grad_v, grad_local_bias = host.window_softmax_backward(
        _KERNELS,
        plan,
        inputs,
        _input_args(*inputs),
        grad_out,
        out,
        lse,
        needs_grad,
        shared_grads=(grad_global_k, grad_global_v, grad_l2g),
    )
    if grad_l2g is not None:
        grad_l2g = grad_l2g.reshape(q.shape[0], q.shape[1], -1, grad_l2g.shape[-1]).sum((0, 2))
    return host.gradient_list(
        [
            grad_q,
            grad_k,
            grad_v,
            host.summed_parts(grad_global_k, global_k),
            host.summed_parts(grad_global_v, global_v),
            grad_local_bias,
            host.cast_like(grad_l2g, l2g_bias),
        ],
        inputs,
        needs_grad,
    )


_KERNELS = host.WindowSoftmaxKernels(
    _sliding_chunk_forward, _sliding_chunk_backward_queries, _sliding_chunk_backward_keys, _sliding_chunk_bias_grad
)
_sliding_chunk_op = host.define_op('triton_sliding_chunk_attention', _forward, _backward, _Inputs)


def triton_sliding_chunk_attention(
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
):
    """:func:`~visattn_mm.ops.sliding_chunk.sliding_chunk_attention` through the Triton kernels.

    Arguments as there. Inputs may be strided views; the output and the
    gradients of ``q, k, v`` are ``(B, heads, H*W, d)`` views of
    ``(B, H*W, heads, d)`` storage, so merging the heads afterwards is free.
    The other inputs are cast to ``q``'s dtype; the biases keep theirs.

    Raises:
        ValueError: For ``dropout_p > 0`` or ``window`` over 11 (not supported
            here; use impl 'fast' or 'math'), an unsupported mode combination, a
            token count other than ``height * width``, biases of other shapes than
            ``(heads, w*w, 9*w*w)`` and ``(heads, G)``, or global keys without
            global values, the reverse, or of another shape than ``(B, heads, G, d)``.
        RuntimeError: For tensors that are not on a CUDA device, unless Triton's
            interpreter is on (``TRITON_INTERPRET=1`` before the kernels are imported).
    """
    host.check_supported('sliding_chunk', q, height * width, window, dropout_p)
    check_modes(masking_mode, shift_mode)
    heads, chunk = q.shape[1], window * window
    host.check_bias_shape(local_bias, (heads, chunk, 9 * chunk), 'local_bias', '(heads, w*w, 9*w*w)')
    k, v = k.to(q.dtype), v.to(q.dtype)
    global_k, global_v = host.shared_keys(global_k, global_v, q, ('global_k', 'global_v'))
    if global_k is None:
        l2g_bias = None
    else:
        host.check_bias_shape(l2g_bias, (heads, global_k.shape[2]), 'l2g_bias', '(heads, G)')
    host.check_device(q)
    return _sliding_chunk_op(
        q, k, v, global_k, global_v, local_bias, l2g_bias, height, width, window, masking_mode, shift_mode
    )[0]
