"""What the float64 references of the ops share.

Each op's reference (``visattn_mm.ops.<op>.reference``) is its naive dense attention: the full
``N x N`` logit matrix with an explicit bias and mask, the reference every fast path is tested
against. They are exact and simple, and quadratic in memory: use them for tests and for small
maps only.
"""

import torch


def pixel_coordinates(height, width):
    """Row and column ``(ys, xs)`` of the ``H*W`` pixels of a map, row-major, each of shape ``(N,)``."""
    ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing='ij')
    return ys.reshape(-1), xs.reshape(-1)
