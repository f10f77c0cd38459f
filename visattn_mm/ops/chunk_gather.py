"""Row gathers of chunked tokens: the fused paths of sliding-chunk and long-short attention.

Both fused paths (:mod:`visattn_mm.ops.sliding_chunk`, :mod:`visattn_mm.ops.long_short`)
make the ``w x w`` chunks (segments) the batch of
:func:`~visattn_mm.ops.common.fused_attention`: queries, and keys with values, are each
one row gather (:class:`ChunkGather`) from the heads-last tokens. This module holds
that path (:func:`chunked_fused_attention`), the gather, its functional form for
torch.export, the constant rows it appends, and the query-side indices both ops share
(the key indices are each op's own).
"""

import contextlib

import torch

from .common import HIDDEN_KEY_LOGIT, chunk_grid, device_cache, fused_attention, storage_key


@device_cache
def chunk_query_index(height, width, window, first, device):
    """Which token each chunk position holds, for :class:`ChunkGather`.

    Args:
        first (int): Tokens before the map's (the leading global ones).

    Returns:
        LongTensor: ``(R*C*w*w,)``: ``first + y * W + x`` for chunk positions in the image,
        ``first + H * W`` (the gather's extra row) for the padding.
    """
    w = window
    rows, cols = chunk_grid(height, width, w)
    inner = torch.arange(w)
    y = (torch.arange(rows) * w)[:, None, None, None] + inner[:, None]  # (R, 1, w, 1)
    x = (torch.arange(cols) * w)[None, :, None, None] + inner[None, :]  # (1, C, 1, w)
    index = torch.where((y < height) & (x < width), y * width + x, height * width)
    return (first + index).reshape(-1).to(device)


@device_cache
def chunk_token_positions(height, width, window, device):
    """Inverse of :func:`chunk_query_index`: the chunk position of every map token.

    Returns:
        LongTensor: ``(H*W,)`` flat indices into ``(R*C*w*w)`` chunk positions, row-major tokens.
    """
    w = window
    cols = chunk_grid(height, width, w)[1]
    y = torch.arange(height)[:, None]
    x = torch.arange(width)[None, :]
    position = ((y // w) * cols + x // w) * (w * w) + (y % w) * w + x % w
    return position.reshape(-1).to(device)


@device_cache
def gather_fill_rows(head_dim, extra, dtype, device):
    """The constant parts of the rows that the fused paths gather (:class:`ChunkGather`).

    With ``extra`` features (see :func:`~visattn_mm.ops.common.fused_attention`): queries get ``[1, 0, ...]``,
    keys and values zeros; the extra row is a zero query with the feature 1, the
    hidden key (zeros, then :data:`HIDDEN_KEY_LOGIT`) and a zero value.

    Returns:
        tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]: ``(features, extra_row)``
        of the queries, ``(1, extra)`` and ``(1, head_dim + extra)``, and of the keys
        and values, ``(2, extra)`` and ``(2, head_dim + extra)``.
    """
    q_features = torch.zeros(1, extra, dtype=dtype)
    kv_features = torch.zeros(2, extra, dtype=dtype)
    q_row = torch.zeros(1, head_dim + extra, dtype=dtype)
    kv_row = torch.zeros(2, head_dim + extra, dtype=dtype)
    if extra:
        q_features[0, 0] = q_row[0, head_dim] = 1
        kv_row[0, head_dim] = HIDDEN_KEY_LOGIT
    return ((q_features.to(device), q_row.to(device)), (kv_features.to(device), kv_row.to(device)))


def gather_rows(index, features, extra_row, *tokens):
    """What :class:`ChunkGather` computes, in functional ops (for torch.export; no custom backward)."""
    outputs, extra = features.shape
    per_output = len(tokens) // outputs
    b, heads, _, d = tokens[0].shape
    gathered = []
    for p in range(outputs):
        rows = torch.cat([t.transpose(1, 2) for t in tokens[p * per_output : (p + 1) * per_output]], dim=1)
        if extra:
            rows = torch.cat([rows, features[p].expand(b, rows.shape[1], heads, extra)], dim=-1)
        rows = torch.cat([rows, extra_row[p].expand(b, 1, heads, d + extra)], dim=1)
        gathered.append(rows.index_select(1, index))
    return tuple(gathered)


def _gathered(index, features, extra_row, *tokens):
    """What :class:`ChunkGather` returns (see there), without autograd: the rows of every output
    written into one buffer, then one ``index_select`` per output."""
    outputs, extra = features.shape
    per_output = len(tokens) // outputs
    b, heads, _, d = tokens[0].shape
    counts = [t.shape[2] for t in tokens[:per_output]]
    total = sum(counts)
    source = tokens[0].new_empty(b, total + 1, outputs, heads, d + extra)
    for p in range(outputs):
        start = 0
        for t, n in zip(tokens[p * per_output : (p + 1) * per_output], counts):
            source[:, start : start + n, p, :, :d].copy_(t.transpose(1, 2))
            start += n
    if extra:
        source[:, :total, :, :, d:].copy_(features[:, None, :].expand(b, total, outputs, heads, extra))
    source[:, total].copy_(extra_row[:, None, :].expand(b, outputs, heads, d + extra))
    return tuple(source[:, :, p].index_select(1, index) for p in range(outputs))


class ChunkGather(torch.autograd.Function):
    """Rows of token tensors gathered by one index: chunks, their neighbours, global tokens.

    ``P`` outputs (queries; or keys and values) share the index. Output ``p``'s
    source rows are its ``S`` token tensors concatenated along the tokens, each row
    extended by ``extra`` constant features, plus one extra constant row at the end
    (index ``M``, the number of tokens). Every output is gathered heads-last in one
    op; the backward accumulates every output's gradient into one buffer with one
    ``index_add_`` each and returns views of it, instead of a zero-filled full-size
    gradient per neighbour slice and the additions of those.

    Args (of ``apply``):
        index (LongTensor): ``(K,)`` source rows, each in ``[0, M]``.
        features (Tensor): ``(P, extra)`` extra features of the token rows.
        extra_row (Tensor): ``(P, d + extra)`` the last row.
        *tokens (Tensor): ``P * S`` tensors ``(B, heads, n_s, d)``, output ``p``'s
            are ``tokens[p*S:(p+1)*S]``, with the same ``n_s`` for every ``p``.

    Returns:
        tuple[Tensor]: ``P`` tensors ``(B, K, heads, d + extra)``.
    """

    @staticmethod
    def forward(ctx, index, features, extra_row, *tokens):
        ctx.save_for_backward(index)
        ctx.counts = [t.shape[2] for t in tokens[: len(tokens) // features.shape[0]]]
        ctx.outputs, ctx.d = features.shape[0], tokens[0].shape[-1]
        return _gathered(index, features, extra_row, *tokens)

    @staticmethod
    def backward(ctx, *grads):
        (index,) = ctx.saved_tensors
        counts, outputs = ctx.counts, ctx.outputs
        reference = next(g for g in grads if g is not None)
        b, _, heads, _ = reference.shape
        d = ctx.d
        grad = reference.new_zeros(b, sum(counts) + 1, outputs, heads, d)
        for p, g in enumerate(grads):
            if g is not None:
                grad[:, :, p].index_add_(1, index, g[..., :d])
        token_grads = []
        for p in range(outputs):
            start = 0
            for n in counts:
                token_grads.append(grad[:, start : start + n, p].transpose(1, 2))
                start += n
        return (None, None, None, *token_grads)


def gather_chunk_rows(index, features, extra_row, *tokens):
    """:class:`ChunkGather`, or its functional twin :func:`gather_rows` where a tracer needs one.

    The twin while torch.export traces (functional ops only), and while torch.compile traces
    without autograd (inference): dynamo then inlines the Function's forward and binds its
    arguments wrongly (torch 2.12: a fake-tensor error in ``expand``).
    """
    if torch.compiler.is_exporting() or (torch.compiler.is_compiling() and not torch.is_grad_enabled()):
        return gather_rows(index, features, extra_row, *tokens)
    return ChunkGather.apply(index, features, extra_row, *tokens)


class _Regathered:
    """What :class:`RegatherInBackward` keeps in place of a saved view of a gathered tensor."""

    def __init__(self, output, view):
        self.output = output
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()


class RegatherInBackward(torch.autograd.graph.saved_tensors_hooks):
    """Within this context, autograd keeps, in place of the gathered rows of :func:`gather_chunk_rows`
    (or views of them), the way to gather them again: the token tensors and the index, which are
    about ``1 / (rows per token)`` of their size. Backward gathers them again (the same copies,
    so the same values) when the op that saved them needs them, e.g. the fused attention's own
    backward, which keeps its output and log-sum-exp as it would.

    The neighbour keys and values of ViL's and ViL-LS's fused paths hold each token about nine
    times; kept by the attention for backward, they are most of these backbones' activation
    memory. Other saved tensors pass through unchanged, and so does a gathered one that an op
    copies before saving it (it is then kept as a copy).

    Args:
        gathered (Sequence[Tensor]): The outputs of one :func:`gather_chunk_rows` call.
        args (tuple): The arguments of that call: ``(index, features, extra_row, *tokens)``.
    """

    def __init__(self, gathered, args):
        self.storages = {storage_key(t): i for i, t in enumerate(gathered)}
        self.args = tuple(a.detach() for a in args)
        self.versions = [a._version for a in args]
        self.cache = {}
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor):
        output = self.storages.get(storage_key(tensor))
        return tensor if output is None else _Regathered(output, tensor)

    def unpack(self, saved):
        if not isinstance(saved, _Regathered):
            return saved
        if saved.output not in self.cache:  # the first of a backward's unpacks: gather every output again
            if [a._version for a in self.args] != self.versions:
                raise RuntimeError(
                    'RegatherInBackward: a tensor the gather reads was modified in place after the forward pass; '
                    'its gathered rows cannot be rebuilt for backward'
                )
            with torch.no_grad():
                self.cache = dict(enumerate(_gathered(*self.args)))
        # Popped: the rows live no longer than the op that needs them.
        return self.cache.pop(saved.output).as_strided(saved.size, saved.stride, saved.offset)


def regathered_in_backward(gathered, args):
    """:class:`RegatherInBackward` for the outputs of ``gather_chunk_rows(*args)`` while autograd
    records (not under torch.compile or torch.export, whose graphs decide what to keep), else a
    context that does nothing."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling() and not torch.compiler.is_exporting():
        return RegatherInBackward(gathered, args)
    return contextlib.nullcontext()


def chunked_fused_attention(q, keys, values, height, width, window, kv_index, bias, hidden, dropout_p, leading_global):
    """:func:`~visattn_mm.ops.common.fused_attention` with the ``w x w`` chunks as its batch.

    The queries ``(B*R*C, h, w*w, d)`` are one row gather from ``q`` (padding positions
    from the extra row), the keys and values ``(B*R*C, h, K, d)`` one row gather from
    ``keys`` and ``values`` by ``kv_index``, all heads-last, as the fused kernels read
    them. The attention keeps, in place of the gathered keys and values, the tokens to
    gather them from (:func:`regathered_in_backward`).

    With a bias, hidden keys are the gather's extra row (see :func:`gather_fill_rows`):
    queries get an extra feature 1, the hidden key the logit
    :data:`~visattn_mm.ops.common.HIDDEN_KEY_LOGIT`, head dim zero-padded to a multiple
    of 8. Without one, ``hidden`` masks them.

    Args:
        q (Tensor): ``(B, heads, first + H*W, d)`` queries, ``first = leading_global``.
        keys (tuple[Tensor]): ``(B, heads, n, d)`` tensors whose rows, concatenated, then
            the extra row, ``kv_index`` counts.
        values (tuple[Tensor]): Likewise, the same sizes.
        height (int): Map height ``H``.
        width (int): Map width ``W``.
        window (int): Chunk size ``w``.
        kv_index (LongTensor): ``(R*C*K,)`` the key rows of every chunk.
        bias (Tensor, optional): ``(heads, w*w, K)``, the same for every chunk.
        hidden (BoolTensor, optional): ``(R*C, K)``, True = hidden; read only without a bias.
        dropout_p (float): Dropout on the attention probabilities.
        leading_global (int): Rows of ``q`` before the map's, never queries here.

    Returns:
        Tensor: ``(B, heads, H*W, d)``.
    """
    b, heads, _, d = q.shape
    rows, cols = chunk_grid(height, width, window)
    extra = 0 if bias is None else 8 - d % 8
    q_rows, kv_rows = gather_fill_rows(d, extra, q.dtype, q.device)
    (q_chunks,) = gather_chunk_rows(chunk_query_index(height, width, window, leading_global, q.device), *q_rows, q)
    kv_args = (kv_index, *kv_rows, *keys, *values)
    k_chunks, v_chunks = gather_chunk_rows(*kv_args)

    def heads_first(t):
        return t.reshape(b * rows * cols, -1, heads, d + extra).transpose(1, 2)

    mask = None if bias is not None else hidden.repeat(b, 1)[:, None, None, :]
    with regathered_in_backward((k_chunks, v_chunks), kv_args):
        out = fused_attention(
            heads_first(q_chunks), heads_first(k_chunks), heads_first(v_chunks), bias, mask, dropout_p
        )
    # Back to map tokens: one gather of the in-image query positions (the padding dropped).
    out = out.transpose(1, 2).reshape(b, rows * cols * window * window, heads, d + extra)
    out = out.index_select(1, chunk_token_positions(height, width, window, q.device))
    return out[..., :d].transpose(1, 2)
