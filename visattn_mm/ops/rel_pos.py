"""Relative-position-bias (RPB) tables shared by the backbones: index formulas and resizing.

The index functions return a LongTensor of row indices into a ``(num_entries, heads)``
table; ``table[index]`` then gives the bias of each (query, key) pair.
"""
import math

import torch

from .common import device_cache

# Neighbour chunks in the order the official ViL code concatenates them
# (row offset, column offset); index 4 is the query's own chunk.
NEIGHBOUR_OFFSETS = ((-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 0), (0, 1), (1, -1), (1, 0), (1, 1))
OWN_CHUNK = 4


def _offset_index(rel_y, rel_x, max_dy, max_dx):
    """Row-major index of an offset inside a (2*max_dy+1) x (2*max_dx+1) grid."""
    return (rel_y + max_dy) * (2 * max_dx + 1) + (rel_x + max_dx)


def sliding_chunk_rpb_index(window):
    """Index of the ViL sliding-chunk RPB table, shape ``(w*w, 9*w*w)``.

    Queries are the ``w*w`` positions of a chunk (row-major); keys are the 9
    neighbour chunks in :data:`NEIGHBOUR_OFFSETS` order, each row-major. The
    offset ``q - k`` lies in ``[-(2w-1), 2w-1]`` per axis, so the table has
    ``(4w-1)**2`` rows.
    """
    w = window
    inner = torch.arange(w)
    qy, qx = torch.meshgrid(inner, inner, indexing='ij')
    qy, qx = qy.reshape(-1), qx.reshape(-1)
    columns = []
    for dy, dx in NEIGHBOUR_OFFSETS:
        ky, kx = qy + dy * w, qx + dx * w
        columns.append(_offset_index(qy[:, None] - ky[None], qx[:, None] - kx[None], 2 * w - 1, 2 * w - 1))
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
    if old_side ** 2 != table.shape[0] or new_side ** 2 != num_rows:
        raise ValueError(f'RPB tables can only be resized between square sizes (g*g rows); got '
                         f'{table.shape[0]} -> {num_rows} rows')
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
    resized = torch.nn.functional.interpolate(table.transpose(1, 2).float(), size=length,
                                              mode='linear', align_corners=False)
    return resized.transpose(1, 2).to(table.dtype)
