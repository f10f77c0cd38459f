"""Relative-position-bias (RPB) tables shared by the backbones: every index formula, and resizing.

The ``*_rpb_row`` functions map query-minus-key offsets to rows of a table (the float64
references ``visattn_mm.ops.<op>.reference`` index with them); the ``*_rpb_index``
functions return a LongTensor of row indices into a ``(num_entries, heads)`` table, so
that ``table[index]`` gives the bias of each (query, key) pair of a chunk (segment, map),
in the key order the attention ops (and their Triton kernels) read the bias in.
"""

import math

import torch

from .common import device_cache
from .indexing import NEIGHBOUR_OFFSETS, segment_pad


def _offset_index(rel_y, rel_x, max_dy, max_dx):
    """Row-major index of an offset inside a (2*max_dy+1) x (2*max_dx+1) grid."""
    return (rel_y + max_dy) * (2 * max_dx + 1) + (rel_x + max_dx)


def sliding_chunk_rpb_row(rel_y, rel_x, window):
    """Row of the ViL sliding-chunk RPB table for the query-minus-key offsets ``(rel_y, rel_x)``,
    each in ``[-(2w-1), 2w-1]``: row-major in the ``(4w-1) x (4w-1)`` grid of offsets."""
    return _offset_index(rel_y, rel_x, 2 * window - 1, 2 * window - 1)


def sliding_chunk_rpb_index(window):
    """Index of the ViL sliding-chunk RPB table, shape ``(w*w, 9*w*w)``.

    Queries are the ``w*w`` positions of a chunk (row-major); keys are the 9
    neighbour chunks in :data:`~visattn_mm.ops.indexing.NEIGHBOUR_OFFSETS` order, each
    row-major. The offset ``q - k`` lies in ``[-(2w-1), 2w-1]`` per axis, so the table
    has ``(4w-1)**2`` rows (:func:`sliding_chunk_rpb_row`).
    """
    w = window
    inner = torch.arange(w)
    qy, qx = torch.meshgrid(inner, inner, indexing='ij')
    qy, qx = qy.reshape(-1), qx.reshape(-1)
    columns = []
    for dy, dx in NEIGHBOUR_OFFSETS:
        ky, kx = qy + dy * w, qx + dx * w
        columns.append(sliding_chunk_rpb_row(qy[:, None] - ky[None], qx[:, None] - kx[None], w))
    return torch.cat(columns, dim=1)


def full_attention_rpb_index(height, width):
    """Swin-style index for full attention over a ``height x width`` map.

    Shape ``(h*w, h*w)`` into a table of ``(2h-1)*(2w-1)`` rows. For a 14x14 map
    this is the same offset->row mapping as :func:`sliding_chunk_rpb_index` with
    ``w=7`` (both tables are 27x27).
    """
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing='ij')
    ys, xs = ys.reshape(-1), xs.reshape(-1)
    return _offset_index(ys[:, None] - ys[None], xs[:, None] - xs[None], height - 1, width - 1)


@device_cache
def cached_full_attention_rpb_index(height, width, device):
    """:func:`full_attention_rpb_index` on ``device``, built once per map size and device
    (:func:`~visattn_mm.ops.common.device_cache`), for maps of a size other than the one a
    module's index buffer was built for."""
    return full_attention_rpb_index(height, width).to(device)


def long_short_rpb_row(rel_y, rel_x, window):
    """Row of the Transformer-LS window RPB table for the query-minus-key offsets ``(rel_y, rel_x)``
    (the official formula, with its aliasing, see :mod:`visattn_mm.ops.long_short`):
    ``(rel_y + s) * (2p + w) + rel_x + s`` with ``s = p + w - 1``, ``p`` the segment pad."""
    p = segment_pad(window)
    shift = p + window - 1
    return (rel_y + shift) * (2 * p + window) + rel_x + shift


def long_short_rpb_table_size(window):
    """Rows of the window RPB table: ``2 (w + p - 1)(2p + w + 1) + 1`` (253 for w=7, 375 for w=8).

    Args:
        window (int): Segment size ``w``.
    """
    p = segment_pad(window)
    return 2 * (window + p - 1) * (2 * p + window + 1) + 1


def long_short_rpb_index(window):
    """Index of the window RPB table, shape ``(w*w, (w + 2p)**2)``, with the official aliasing.

    Rows are the queries of a segment (row-major), columns the keys of its patch
    (row-major, starting at offset ``(-p, -p)`` from the segment's corner).

    Args:
        window (int): Segment size ``w``.
    """
    w, p = window, segment_pad(window)
    q = torch.arange(w)
    k = torch.arange(-p, w + p)
    qy, qx = (t.reshape(-1) for t in torch.meshgrid(q, q, indexing='ij'))
    ky, kx = (t.reshape(-1) for t in torch.meshgrid(k, k, indexing='ij'))
    return long_short_rpb_row(qy[:, None] - ky[None], qx[:, None] - kx[None], w)


def resize_rpb_table(table, num_rows):
    """Bilinearly resize a square RPB table to ``num_rows`` rows.

    A table of ``g*g`` rows indexes a ``g x g`` grid of offsets (row-major); each
    head's grid is an image that is resized to ``n x n`` with
    ``align_corners=False`` (as the official ViL converter does), ``n*n = num_rows``.

    Args:
        table (Tensor): ``(g*g, heads)``.
        num_rows (int): Rows of the resized table, a perfect square.

    Returns:
        Tensor: ``(num_rows, heads)``, in the input dtype.

    Raises:
        ValueError: If either size is not a perfect square: such tables (e.g.
            Transformer-LS' aliased window table) have no 2-D grid to resize.
    """
    old_side, new_side = math.isqrt(table.shape[0]), math.isqrt(num_rows)
    if old_side**2 != table.shape[0] or new_side**2 != num_rows:
        raise ValueError(
            f'RPB tables can only be resized between square sizes (g*g rows); got {table.shape[0]} -> {num_rows} rows'
        )
    return resize_rpb_grid(table, (old_side, old_side), (new_side, new_side))


def resize_rpb_grid(table, grid, new_grid):
    """Bilinearly resize an RPB table whose rows are a ``grid`` of offsets (row-major).

    The full-attention table of an ``h x w`` map has a ``(2h-1) x (2w-1)`` grid; each
    head's grid is resized like an image (``align_corners=False``, the resize of
    :func:`resize_rpb_table`), which differentiates back to ``table``.

    Args:
        table (Tensor): ``(rows * cols, heads)`` with ``grid = (rows, cols)``.
        grid (tuple[int, int]): The offset grid of ``table``.
        new_grid (tuple[int, int]): The offset grid to resize to.

    Returns:
        Tensor: ``(new_rows * new_cols, heads)`` in the input dtype; ``table``
        itself when the grids are equal.
    """
    grid, new_grid = tuple(grid), tuple(new_grid)
    if grid == new_grid:
        return table
    heads = table.shape[1]
    image = table.T.reshape(1, heads, *grid).float()
    image = torch.nn.functional.interpolate(image, size=new_grid, mode='bilinear', align_corners=False)
    return image.reshape(heads, new_grid[0] * new_grid[1]).T.to(table.dtype).contiguous()


def resize_1d_table(table, length):
    """Linearly resize a ``(1, n, C)`` position table to ``(1, length, C)`` (align_corners=False)."""
    if table.shape[1] == length:
        return table
    resized = torch.nn.functional.interpolate(
        table.transpose(1, 2).float(), size=length, mode='linear', align_corners=False
    )
    return resized.transpose(1, 2).to(table.dtype)
