"""Index arithmetic and constants that the torch paths, the Triton kernels and the float64 references share.

Below every attention op (it imports only :mod:`visattn_mm.ops.common`), so that
the references and the Triton modules of the ops (``visattn_mm.ops.<op>.reference``,
``visattn_mm.ops.<op>.triton``) take these from here and never from another op's package:

* ViL sliding chunks: the neighbour chunks, masking and shift modes
  (see :mod:`visattn_mm.ops.sliding_chunk`).
* Transformer-LS segments: the key patch's padding (see :mod:`visattn_mm.ops.long_short`).
* Pale attention: pale sizes, head halves and the interlacing of an axis
  (see :mod:`visattn_mm.ops.pale`).
* Vicinity attention: the signed clamp's bounds, the normaliser's eps and the
  position weights (see :mod:`visattn_mm.ops.vicinity`).

The relative-position-bias index formulas live in :mod:`visattn_mm.ops.rel_pos`.
"""

import math

import torch

from .common import device_cache, is_symbolic

# Neighbour chunks in the order the official ViL code concatenates them
# (row offset, column offset); index 4 is the query's own chunk. The Triton kernels compute
# block b's offset as (b // 3 - 1, b % 3 - 1), this order.
NEIGHBOUR_OFFSETS = ((-1, -1), (-1, 0), (-1, 1), (0, -1), (0, 0), (0, 1), (1, -1), (1, 0), (1, 1))
OWN_CHUNK = 4

# Sliding-chunk attention's masking and shift modes (see visattn_mm.ops.sliding_chunk).
MASKING_MODES = (0, -1, 1)
SHIFT_MODES = (0, -1, 1, 2, 3, 4, 5, 6, 7, 8)


def neighbour_blocks(shift_mode):
    """Indices into ``NEIGHBOUR_OFFSETS`` of the key chunks used by a shift mode."""
    if shift_mode == 0:
        return tuple(range(9))
    if shift_mode == -1:
        return (OWN_CHUNK,)
    if 1 <= shift_mode <= 8:
        # Neighbour k is the k-th non-centre block: block k-1 before the centre, k after.
        return (OWN_CHUNK, shift_mode - 1 if shift_mode <= 4 else shift_mode)
    raise ValueError(f'shift_mode must be one of {SHIFT_MODES}, got {shift_mode!r}')


def check_modes(masking_mode, shift_mode, random_shift=False):
    """Raise a ValueError naming the problem for an unsupported mode combination: the one check of
    sliding-chunk attention's modes, wherever they are taken (the op, its Triton kernels and reference,
    the attention module and ViL's arguments, :func:`~visattn_mm.models.vil.set_random_shift`).

    Args:
        masking_mode (int): One of :data:`MASKING_MODES`.
        shift_mode (int): One of :data:`SHIFT_MODES`.
        random_shift (bool): Whether training draws the shift (1..8) at random: every draw must
            work with the masking mode.
    """
    if masking_mode not in MASKING_MODES:
        raise ValueError(f'masking_mode must be one of {MASKING_MODES}, got {masking_mode!r}')
    neighbour_blocks(shift_mode)
    if masking_mode == 1 and (shift_mode != 0 or random_shift):
        raise ValueError(
            'masking_mode=1 (exact window) needs all 8 neighbour chunks; it cannot be '
            f'combined with shift_mode={shift_mode} or random shift. Use masking_mode=0.'
        )


def segment_pad(window):
    """Keys on each side of a segment in the window branch: ``p = max(w // 2, 1)``.

    The official code uses ``max(w // 2, 1)`` for the key patch and ``int(0.5 * w)``
    for the RPB table; the two agree for every ``w >= 2`` (the only sizes at which its
    RPB shapes fit). One value serves both here.

    Args:
        window (int): Segment size ``w``.

    Returns:
        int: ``p`` (3 for w=7, 4 for w=8).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f'window must be a positive int, got {window!r}')
    return max(window // 2, 1)


def pale_size_pair(pale_size):
    """``(s_r, s_c)`` from a pale size given as ``s`` or ``(s_r, s_c)``."""
    return tuple(pale_size) if isinstance(pale_size, (tuple, list)) else (pale_size, pale_size)


def half_heads(q):
    """Heads of each branch (row, column) of ``(B, heads, N, d)`` queries.

    Raises:
        ValueError: For an odd number of heads.
    """
    heads = q.shape[1]
    if heads % 2:
        raise ValueError(f'pale_attention: {heads} heads cannot be split between the row and column halves')
    return heads // 2


def interlace_stride(side, pale_size):
    """``(effective pale size, stride, padded side)`` of one axis.

    ``stride = ceil(side / s)`` groups of ``s_eff = min(s, side)`` interlaced lines;
    the axis is padded to ``stride * s_eff >= side``.
    """
    if not isinstance(pale_size, int) or pale_size < 1:
        raise ValueError(f'pale_size must be a positive int, got {pale_size!r}')
    if is_symbolic(side):
        # An exported graph holds one grouping: it serves maps at least one pale wide
        # (checked at run time), which keeps the symbolic sizes solvable.
        torch._check(side >= pale_size, lambda: f'exported Pale attention needs map sides >= {pale_size}')
        size = pale_size
    else:
        size = min(pale_size, side)
    stride = -(-side // size)
    return size, stride, stride * size


# Vicinity attention's signed clamp: magnitudes forced into [CLAMP_MIN, CLAMP_MAX].
CLAMP_MIN = 1e-4
CLAMP_MAX = 1e4
EPS = 1e-4  # added to the normaliser's denominator (official value)


def vicinity_positions(height, width, device=None, dtype=torch.float32):
    """Row and column angles ``(a, b)`` of the ``H*W`` tokens, each of shape ``(N,)``.

    ``a = (pi/2) * row / H`` and ``b = (pi/2) * col / W`` for token ``t = row * W + col``;
    both lie in ``[0, pi/2)``, so all cosines and sines are non-negative.
    """
    index = torch.arange(height * width, device=device, dtype=torch.float64)
    rows, cols = torch.div(index, width, rounding_mode='floor'), torch.remainder(index, width)
    a = (math.pi / 2) * rows / height
    b = (math.pi / 2) * cols / width
    return a.to(dtype), b.to(dtype)


@device_cache
def vicinity_weights(height, width, device=None, dtype=torch.float32):
    """``(N, 4)`` weights ``[cos a, sin a, cos b, sin b]`` of each token, built once per map size,
    device and dtype (:func:`~visattn_mm.ops.common.device_cache`).

    The angles and their cosines and sines are computed in at least fp32, then cast to ``dtype``.
    """
    compute = torch.promote_types(dtype, torch.float32)
    a, b = vicinity_positions(height, width, device, compute)
    return torch.stack([torch.cos(a), torch.sin(a), torch.cos(b), torch.sin(b)], dim=-1).to(dtype)
