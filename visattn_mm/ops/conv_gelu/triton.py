"""Triton kernels of :func:`~visattn_mm.ops.conv_gelu.depthwise_conv_gelu`.

Tokens ``(B, N = H*W, C)``, channels last: a program takes ``BLOCK_N`` consecutive tokens of one image
and ``BLOCK_D`` channels; a token's 3x3 neighbours are loads of the same tensor at shifted token indices
(masked outside the map: the convolution's zero padding), which the cache serves to the neighbouring rows.

* ``_conv_gelu_forward``: ``y = gelu(z)``, ``z = bias + sum over the 9 taps of w[tap] * x[token + offset(tap)]``;
  one pass reading ``x`` and writing ``y``.
* ``_conv_gelu_backward_pre``: recomputes ``z`` and writes ``dz = dy * gelu'(z)``, and each program's sums of
  ``dz`` (the bias gradient) and of ``x[token + offset(tap)] * dz`` per tap (the weight gradient), which the host
  adds up in a fixed order: the same bits on every run, no atomics.
* ``_conv_gelu_backward_input``: ``dx[token] = sum over taps of w[tap] * dz[token - offset(tap)]``.

Sums in fp32 (fp64 for fp64 inputs); ``y``, ``dz`` and ``dx`` are stored in the inputs' dtype. The
interpreter: see :mod:`visattn_mm.ops.triton`.
"""

# First, before `import triton`: importing the shared package visattn_mm.ops.triton names the fix where
# triton does not import.
from typing import NamedTuple  # noqa: I001 (visattn_mm.ops.triton first)

from ..triton import host

import torch
import triton
import triton.language as tl

__all__ = ['triton_depthwise_conv_gelu', 'triton_depthwise_conv_gelu_backward']


class _Tile(NamedTuple):
    """The kernels' compile-time constants.

    Args:
        BLOCK_N (int): Tokens of a program.
        BLOCK_D (int): Channels of a program (named as the attention kernels' feature tile, which the
            launch-settings table is keyed by).
        ACC (tl.dtype): The sums' dtype.
    """

    BLOCK_N: int
    BLOCK_D: int
    ACC: object


# Tokens a program takes, and its channel tile's largest side: 32 x 64 elements a tile, nine such neighbour loads
# per kernel, over 8 warps (with 4 the first backward kernel spills 492 bytes per thread on sm_90). Not timed yet.
BLOCK_N = 32
MAX_BLOCK_D = 64
SQRT1_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _offsets(rows, cols, batch, tokens, channels):
    """Offsets of a ``(rows, cols)`` tile of image ``batch`` in contiguous ``(B, tokens, channels)`` tokens, and
    which of them lie inside."""
    inside = (rows < tokens)[:, None] & (cols < channels)[None, :]
    return batch * tokens * channels + rows[:, None] * channels + cols[None, :], inside


@triton.jit
def _neighbours(t, rows, cols, batch, geometry, TAP: tl.constexpr, SIGN: tl.constexpr):
    """The tile of ``t`` at the tokens ``SIGN`` times the offset of ``TAP`` (0-8, row-major in the 3x3 window) away
    from ``rows``, zero outside the map."""
    height, width, channels = geometry
    row = rows // width + SIGN * (TAP // 3 - 1)
    column = rows % width + SIGN * (TAP % 3 - 1)
    inside = (rows < height * width) & (row >= 0) & (row < height) & (column >= 0) & (column < width)
    offsets = batch * height * width * channels + (row * width + column)[:, None] * channels + cols[None, :]
    return tl.load(t + offsets, mask=inside[:, None] & (cols < channels)[None, :], other=0.0)


@triton.jit
def _tap_weights(weight, cols, channels, TAP: tl.constexpr, ACC: tl.constexpr):
    return tl.load(weight + cols * 9 + TAP, mask=cols < channels, other=0.0).to(ACC)[None, :]


@triton.jit
def _preactivation(x, weight, bias, rows, cols, batch, geometry, tile: tl.constexpr):
    """``z`` of a tile: the bias plus the nine taps' products, summed in ``tile.ACC``."""
    channels = geometry[2]
    z = tl.zeros([tile.BLOCK_N, tile.BLOCK_D], tile.ACC)
    for tap in tl.static_range(9):
        z += _neighbours(x, rows, cols, batch, geometry, tap, 1).to(tile.ACC) * _tap_weights(
            weight, cols, channels, tap, tile.ACC
        )
    return z + tl.load(bias + cols, mask=cols < channels, other=0.0).to(tile.ACC)[None, :]


@triton.jit
def _tile_indices(tile: tl.constexpr):
    rows = tl.program_id(0) * tile.BLOCK_N + tl.arange(0, tile.BLOCK_N)
    cols = tl.program_id(1) * tile.BLOCK_D + tl.arange(0, tile.BLOCK_D)
    return rows, cols, tl.program_id(2)


@triton.jit
def _conv_gelu_forward(x, weight, bias, out, geometry, tile: tl.constexpr):
    height, width, channels = geometry
    rows, cols, batch = _tile_indices(tile)
    z = _preactivation(x, weight, bias, rows, cols, batch, geometry, tile)
    offsets, inside = _offsets(rows, cols, batch, height * width, channels)
    tl.store(out + offsets, (0.5 * z * (1.0 + tl.math.erf(z * SQRT1_2))).to(out.dtype.element_ty), mask=inside)


@triton.jit
def _conv_gelu_backward_pre(
    x, weight, bias, grad_out, grad_pre, weight_parts, bias_parts, geometry, tile: tl.constexpr
):
    height, width, channels = geometry
    rows, cols, batch = _tile_indices(tile)
    z = _preactivation(x, weight, bias, rows, cols, batch, geometry, tile)
    offsets, inside = _offsets(rows, cols, batch, height * width, channels)
    grad_y = tl.load(grad_out + offsets, mask=inside, other=0.0).to(tile.ACC)
    # gelu'(z) = Phi(z) + z phi(z); rows outside the map have grad_y = 0, so their dz is 0.
    grad_z = grad_y * (0.5 * (1.0 + tl.math.erf(z * SQRT1_2)) + z * tl.exp(-0.5 * z * z) * INV_SQRT_2PI)
    tl.store(grad_pre + offsets, grad_z.to(grad_pre.dtype.element_ty), mask=inside)
    part = batch * tl.num_programs(0) + tl.program_id(0)
    cols_inside = cols < channels
    tl.store(bias_parts + part * channels + cols, tl.sum(grad_z, 0), mask=cols_inside)
    for tap in tl.static_range(9):
        shifted = _neighbours(x, rows, cols, batch, geometry, tap, 1).to(tile.ACC)
        tl.store(weight_parts + (part * 9 + tap) * channels + cols, tl.sum(shifted * grad_z, 0), mask=cols_inside)


@triton.jit
def _conv_gelu_backward_input(grad_pre, weight, grad_x, geometry, tile: tl.constexpr):
    height, width, channels = geometry
    rows, cols, batch = _tile_indices(tile)
    grad = tl.zeros([tile.BLOCK_N, tile.BLOCK_D], tile.ACC)
    for tap in tl.static_range(9):
        grad += _neighbours(grad_pre, rows, cols, batch, geometry, tap, -1).to(tile.ACC) * _tap_weights(
            weight, cols, channels, tap, tile.ACC
        )
    offsets, inside = _offsets(rows, cols, batch, height * width, channels)
    tl.store(grad_x + offsets, grad.to(grad_x.dtype.element_ty), mask=inside)


def _launch_setup(x, height, width):
    """Grid, launch settings (8 warps: see :data:`BLOCK_N`), geometry argument and ``tile`` bundle of the three
    kernels."""
    batch, tokens, channels = x.shape
    block_d = min(MAX_BLOCK_D, host.tile(channels))
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    grid = (triton.cdiv(tokens, BLOCK_N), triton.cdiv(channels, block_d), batch)
    return grid, dict(num_warps=8), (height, width, channels), host.constant_bundle(_Tile(BLOCK_N, block_d, acc))


@torch.library.custom_op('visattn_mm::triton_depthwise_conv_gelu', mutates_args=())
def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, height: int, width: int) -> torch.Tensor:
    grid, settings, geometry, tile = _launch_setup(x, height, width)
    out = torch.empty_like(x)
    host.launch(_conv_gelu_forward, grid, settings, x, weight, bias, out, geometry, tile=tile)
    return out


@_forward.register_fake
def _(x, weight, bias, height, width):
    return torch.empty_like(x)


@torch.library.custom_op('visattn_mm::triton_depthwise_conv_gelu_backward', mutates_args=())
def _backward(
    grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, height: int, width: int
) -> list[torch.Tensor]:
    """The gradients of ``x``, ``weight`` and ``bias``."""
    grid, settings, geometry, tile = _launch_setup(x, height, width)
    grad_out = grad_out.contiguous()
    parts = grid[0] * grid[2]
    acc_dtype = host.acc_dtype(x.dtype)
    grad_pre = torch.empty_like(x)
    weight_parts = x.new_empty(parts, 9, x.shape[2], dtype=acc_dtype)
    bias_parts = x.new_empty(parts, x.shape[2], dtype=acc_dtype)
    host.launch(
        _conv_gelu_backward_pre,
        grid,
        settings,
        x,
        weight,
        bias,
        grad_out,
        grad_pre,
        weight_parts,
        bias_parts,
        geometry,
        tile=tile,
    )
    grad_x = torch.empty_like(x)
    host.launch(_conv_gelu_backward_input, grid, settings, grad_pre, weight, grad_x, geometry, tile=tile)
    grad_weight = weight_parts.sum(0).t().reshape(weight.shape).to(weight.dtype)
    return [grad_x, grad_weight, bias_parts.sum(0).to(bias.dtype)]


@_backward.register_fake
def _(grad_out, x, weight, bias, height, width):
    return [torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)]


def _setup_context(ctx, inputs, output):
    x, weight, bias, height, width = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.geometry = (height, width)


def _differentiate(ctx, grad_out):
    grad_x, grad_weight, grad_bias = _backward(grad_out, *ctx.saved_tensors, *ctx.geometry)
    return grad_x, grad_weight, grad_bias, None, None


_forward.register_autograd(_differentiate, setup_context=_setup_context)


def _operands(x, weight, bias):
    """``x`` contiguous (a linear layer's output already is), ``weight`` and ``bias`` cast to its dtype."""
    host.check_device(x, "impl 'math' (VVT: fused_conv_gelu=False)")
    return x.contiguous(), weight.to(x.dtype).contiguous(), bias.to(x.dtype).contiguous()


def triton_depthwise_conv_gelu(x, height, width, weight, bias):
    """:func:`~visattn_mm.ops.conv_gelu.depthwise_conv_gelu` through the Triton kernels (arguments as there,
    checked there); ``weight`` and ``bias`` are cast to ``x``'s dtype, as autocast would.

    Raises:
        RuntimeError: For tensors that are not on a CUDA device, unless Triton's interpreter is on.
    """
    return _forward(*_operands(x, weight, bias), int(height), int(width))


def triton_depthwise_conv_gelu_backward(grad_out, x, height, width, weight, bias):
    """:func:`~visattn_mm.ops.conv_gelu.depthwise_conv_gelu_backward` through the Triton kernels: the gradients of
    ``x``, ``weight`` and ``bias`` (in ``x``'s dtype)."""
    return tuple(_backward(grad_out.to(x.dtype), *_operands(x, weight, bias), int(height), int(width)))
