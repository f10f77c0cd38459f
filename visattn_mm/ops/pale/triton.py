"""Pale-shaped attention as Triton kernels (``impl='triton'``), forward and backward.

The same function as :func:`visattn_mm.ops.pale.pale_attention` (see there and
:func:`visattn_mm.ops.pale.reference.pale_attention_dense`), computed without
gathering, padding or permuting the groups and without storing logits. The
kernels read each group's tokens straight from the ``(B, heads, H*W, d)``
tensors: slot ``t`` of group ``g`` is line ``g + (t // L) * stride`` of the
grouping axis and position ``t % L`` along the other one (``L`` its length);
slots on lines beyond the map (the padding of :func:`~visattn_mm.ops.indexing.interlace_stride`)
are masked loads. The row branch (first half of the heads) groups rows, the
column branch (second half) columns: one launch per branch and kernel, one
program per (group, tile of its tokens, batch * head of the branch).

* Forward: online softmax (FlashAttention style) over the group's keys in tiles;
  saves one log-sum-exp per query.
* Backward (FlashAttention-2 style, probabilities recomputed from the
  log-sum-exp): a query-centric kernel writes ``delta = rowsum(dO * O)`` and the
  gradient of the queries; a key-centric kernel then loops over the group's
  queries and writes the gradients of the keys and values.

A row group holds ``s_r * W`` tokens, a column group ``s_c * H``: tiles of at
most :data:`MAX_BLOCK` slots (fewer for small groups). No bias; numerics and
dtypes: see :mod:`visattn_mm.ops.triton.kernel_parts`; the interpreter: see
:mod:`visattn_mm.ops.triton`.

Dropout is not supported: ``dropout_p > 0`` raises a ValueError (choose
``impl='fast'`` or ``'math'`` for attention dropout).
"""

from typing import NamedTuple  # noqa: I001 (visattn_mm.ops.triton first)

# First, before `import triton`: importing the shared package visattn_mm.ops.triton names the fix where
# triton does not import.
from ..triton import host, kernel_parts as kp

import torch
import triton
import triton.language as tl

from ..indexing import half_heads, interlace_stride, pale_size_pair

__all__ = ['triton_pale_attention']

# Largest tile side (query and key tiles alike); tests lower it to run the tile loops at tiny sizes.
MAX_BLOCK = 64


class _Branch(NamedTuple):
    """The kernels' geometry argument for the row or the column branch (see :func:`_branches`): the op's
    ``heads`` and ``tokens_per_map``; the branch's ``half`` of the heads from ``head_start``, ``tiles`` per
    group; the map's ``side`` lines (rows or columns) of ``length`` tokens, every ``stride``-th line in a
    group of ``group_size`` tokens; the token index steps ``line_step`` from one line to the next and
    ``other_step`` along a line; and ``head_dim``."""

    heads: int
    tokens_per_map: int
    half: int
    head_start: int
    tiles: int
    side: int
    length: int
    stride: int
    group_size: int
    line_step: int
    other_step: int
    head_dim: int


@triton.jit
def _group_slots(group, start, geometry, BLOCK: tl.constexpr):
    """Token index (row-major) of slots ``start .. start + BLOCK`` of an interlaced group, and whether
    each slot is a token of the map (not beyond the group or on a padding line)."""
    slots = start + tl.arange(0, BLOCK)
    line = group + (slots // geometry.length) * geometry.stride
    valid = (slots < geometry.group_size) & (line < geometry.side)
    return line * geometry.line_step + (slots % geometry.length) * geometry.other_step, valid


@triton.jit
def _group_key_tile(
    queries,
    group,
    start,
    k,
    v,
    batch,
    head,
    geometry,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Keys and values of slots ``start .. start + BLOCK`` of a group and their ``(queries, keys)`` tile of
    logits, ``-inf`` at the slots that are no token of the map: the loop body of the forward and the
    query-side backward kernel."""
    key_tokens, key_valid = _group_slots(group, start, geometry, BLOCK)
    keys, values, scores = kp.key_tile(
        queries, k, v, batch, head, key_tokens, key_valid, geometry.head_dim, BLOCK_D, DOT_PRECISION
    )
    return keys, values, tl.where(key_valid[None, :], scores, float('-inf'))


@triton.jit
def _program_tile(geometry):
    """This program's ``(group, tile, batch, head, lse row)`` on a ``(groups * tiles, batch * half)`` grid of
    a branch whose heads start at ``head_start``; the lse row is the offset of its (batch, head) pair in
    the ``(B * heads, H * W)`` log-sum-exps and deltas."""
    tile = tl.program_id(0)
    batch_head = tl.program_id(1)
    batch, head = batch_head // geometry.half, geometry.head_start + batch_head % geometry.half
    row = (batch * geometry.heads + head) * geometry.tokens_per_map
    return tile // geometry.tiles, tile % geometry.tiles, batch, head, row


@triton.jit
def _pale_forward(q, k, v, out, lse, geometry, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Output and log-sum-exp of one tile of a group's queries; grid ``(groups * tiles, batch * half)``."""
    group, tile, batch, head, row = _program_tile(geometry)
    group_size, head_dim = geometry.group_size, geometry.head_dim
    tokens, query_valid = _group_slots(group, tile * BLOCK, geometry, BLOCK)
    queries = kp.load_rows(q, batch, head, tokens, query_valid, head_dim, BLOCK_D)

    row_max, row_sum, acc = kp.softmax_start(lse, BLOCK, BLOCK_D)
    for start in range(0, group_size, BLOCK):
        _, values, scores = _group_key_tile(
            queries, group, start, k, v, batch, head, geometry, BLOCK, BLOCK_D, DOT_PRECISION
        )
        row_max, row_sum, acc = kp.softmax_step(row_max, row_sum, acc, scores, values, DOT_PRECISION)

    kp.finish_forward(out, batch, head, lse + row, tokens, query_valid, head_dim, row_max, row_sum, acc, BLOCK_D)


@triton.jit
def _pale_backward_queries(
    q,
    k,
    v,
    out,
    grad_out,
    lse,
    delta,
    grad_q,
    geometry,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """``delta`` (read by :func:`_pale_backward_keys`) and the gradient of one tile of a group's queries;
    grid ``(groups * tiles, batch * half)``."""
    group, tile, batch, head, row = _program_tile(geometry)
    group_size, head_dim = geometry.group_size, geometry.head_dim
    tokens, query_valid = _group_slots(group, tile * BLOCK, geometry, BLOCK)
    query_rows = kp.backward_rows(
        q, grad_out, out, batch, head, lse + row, delta + row, tokens, query_valid, head_dim, BLOCK_D
    )
    queries = query_rows[0]

    grad_queries = kp.accumulator(lse, BLOCK, BLOCK_D)
    for start in range(0, group_size, BLOCK):
        keys, values, scores = _group_key_tile(
            queries, group, start, k, v, batch, head, geometry, BLOCK, BLOCK_D, DOT_PRECISION
        )
        _, grad_scores = kp.logit_grads(scores, query_rows, values, DOT_PRECISION)
        grad_queries += tl.dot(grad_scores.to(keys.dtype), keys, input_precision=DOT_PRECISION)

    kp.store_rows(grad_q, batch, head, tokens, query_valid, head_dim, grad_queries, BLOCK_D)


@triton.jit
def _pale_backward_keys(
    q,
    k,
    v,
    grad_out,
    lse,
    delta,
    grad_k,
    grad_v,
    geometry,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Gradients of one tile of a group's keys and values; grid ``(groups * tiles, batch * half)``.

    The padding key slots are not masked here: their rows of the gradients are
    never stored, and the products never mix rows.
    """
    group, tile, batch, head, row = _program_tile(geometry)
    group_size, head_dim = geometry.group_size, geometry.head_dim
    key_tokens, key_valid = _group_slots(group, tile * BLOCK, geometry, BLOCK)
    keys, values = kp.key_value_rows(k, v, batch, head, key_tokens, key_valid, head_dim, BLOCK_D)
    grad_keys, grad_values = kp.accumulator(lse, BLOCK, BLOCK_D), kp.accumulator(lse, BLOCK, BLOCK_D)
    for start in range(0, group_size, BLOCK):
        tokens, query_valid = _group_slots(group, start, geometry, BLOCK)
        query_rows, scores = kp.query_tile(
            keys,
            q,
            grad_out,
            batch,
            head,
            lse + row,
            delta + row,
            tokens,
            query_valid,
            head_dim,
            BLOCK_D,
            DOT_PRECISION,
        )
        grad_keys, grad_values = kp.key_grads_step(grad_keys, grad_values, scores, values, query_rows, DOT_PRECISION)

    kp.store_key_grads(grad_k, grad_v, batch, head, key_tokens, key_valid, head_dim, grad_keys, grad_values, BLOCK_D)


def _branches(batch, heads, head_dim, height, width, pale_size):
    """Launch geometry of the row and the column branch.

    Returns:
        list[tuple]: Per branch, its grid ``(groups * tiles, batch * half)``, the
        kernels' geometry argument (:class:`_Branch`) and its tile side.
    """
    half = heads // 2
    s_r, s_c = pale_size_pair(pale_size)
    branches = []
    # (side, length, line step, other step, heads from): rows step by W tokens, columns by 1.
    for side, length, line_step, other_step, size_asked, head_start in (
        (height, width, width, 1, s_r, 0),
        (width, height, 1, width, s_c, half),
    ):
        size, stride, _ = interlace_stride(side, size_asked)
        group_size = size * length
        block = min(host.tile(group_size), MAX_BLOCK)
        tiles = triton.cdiv(group_size, block)
        geometry = _Branch(
            heads,
            height * width,
            half,
            head_start,
            tiles,
            side,
            length,
            stride,
            group_size,
            line_step,
            other_step,
            head_dim,
        )
        branches.append(((stride * tiles, batch * half), geometry, block))
    return branches


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, height: int, width: int, pale_rows: int, pale_cols: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and the log-sum-exp of each query's logits, ``(B * heads, H * W)``."""
    batch, heads, _, head_dim = q.shape
    constexprs = dict(BLOCK_D=host.tile(head_dim), DOT_PRECISION=host.dot_precision(q.dtype))
    settings = host.launch_settings(q.dtype)
    out, lse = host.forward_outputs(q)
    views = [*map(host.head_rows, (q, k, v, out)), lse]
    for grid, geometry, block in _branches(batch, heads, head_dim, height, width, (pale_rows, pale_cols)):
        host.launch(_pale_forward, grid, settings, *views, geometry, BLOCK=block, **constexprs)
    return out, lse


def _backward(grad_out, q, k, v, out, lse, height, width, pale_rows, pale_cols, needs_grad):
    """The gradients of ``q, k, v``."""
    batch, heads, _, head_dim = q.shape
    constexprs = dict(BLOCK_D=host.tile(head_dim), DOT_PRECISION=host.dot_precision(q.dtype))
    settings = host.launch_settings(q.dtype)
    grad_out, grad_q, grad_k, grad_v, delta, _ = host.backward_buffers(q, k, v, grad_out, lse, None, False)
    q_rows, k_rows, v_rows, grad_out_rows = map(host.head_rows, (q, k, v, grad_out))
    for grid, geometry, block in _branches(batch, heads, head_dim, height, width, (pale_rows, pale_cols)):
        host.launch(
            _pale_backward_queries,
            grid,
            settings,
            q_rows,
            k_rows,
            v_rows,
            host.head_rows(out),
            grad_out_rows,
            lse,
            delta,
            host.head_rows(grad_q),
            geometry,
            BLOCK=block,
            **constexprs,
        )
        host.launch(
            _pale_backward_keys,
            grid,
            settings,
            q_rows,
            k_rows,
            v_rows,
            grad_out_rows,
            lse,
            delta,
            host.head_rows(grad_k),
            host.head_rows(grad_v),
            geometry,
            BLOCK=block,
            **constexprs,
        )
    return host.gradient_list([grad_q, grad_k, grad_v], (q, k, v), needs_grad)


_pale_op = host.define_op('triton_pale_attention', _forward, _backward, host.QKV)


def triton_pale_attention(q, k, v, height, width, pale_size, dropout_p=0.0):
    """:func:`~visattn_mm.ops.pale.pale_attention` through the Triton kernels.

    Arguments as there. Inputs may be strided views; the output and the
    gradients of ``q, k, v`` are ``(B, heads, H*W, d)`` views of
    ``(B, H*W, heads, d)`` storage, so merging the heads afterwards is free.
    ``k`` and ``v`` are cast to ``q``'s dtype.

    Raises:
        ValueError: For ``dropout_p > 0`` (not supported here; use impl 'fast'
            or 'math'), a token count other than ``height * width``, an odd
            number of heads, or a pale size that is not a positive int.
        RuntimeError: For tensors that are not on a CUDA device, unless Triton's
            interpreter is on (``TRITON_INTERPRET=1`` before the kernels are imported).
    """
    host.check_supported('pale', q, height * width, dropout_p=dropout_p)
    half_heads(q)
    for side, size in zip((height, width), pale_size_pair(pale_size)):
        interlace_stride(side, size)
    k, v = k.to(q.dtype), v.to(q.dtype)
    host.check_device(q)
    return _pale_op(q, k, v, height, width, *pale_size_pair(pale_size))[0]
