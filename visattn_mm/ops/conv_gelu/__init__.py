"""The 3x3 depthwise convolution and exact GELU of a conv-FFN (PVTv2's, VVT's) as one op on tokens.

:func:`depthwise_conv_gelu` computes ``gelu(conv2d(x, weight, bias, padding=1, groups=C))`` for tokens
``x`` ``(B, H*W, C)`` laid out row-major over an ``H x W`` map, and returns tokens. Two paths, chosen by
the ``impl`` argument:

* ``'math'``: torch's convolution on the tokens' ``(B, C, H, W)`` view, then its GELU; in float64 it is
  the reference the other path is tested against.
* ``'triton'``: :mod:`visattn_mm.ops.conv_gelu.triton`, one kernel forward, two backward, reading and
  writing the hidden-wide tensors about half as often as the torch path (GPU.md's count for VVT-S:
  ~14 passes over them per block for the conv-FFN, ~5 fused). CUDA tensors, or CPU tensors under
  Triton's interpreter (tests).

Not an attention op (no row in :mod:`visattn_mm.ops.specs`): VVT runs it only where it is asked to
(``fused_conv_gelu=True``), since no GPU has timed it yet.
"""

import torch
import torch.nn.functional as F

IMPLS = ('math', 'triton')


def depthwise_conv_gelu(x, height, width, weight, bias, impl='math'):
    """``gelu(depthwise_conv3x3(x) + bias)`` on tokens.

    Args:
        x (torch.Tensor): Tokens ``(B, height * width, C)``, row-major over the map.
        height (int): Map rows.
        width (int): Map columns.
        weight (torch.Tensor): The convolution's weight ``(C, 1, 3, 3)``.
        bias (torch.Tensor): Its bias ``(C,)``.
        impl (str): ``'math'`` or ``'triton'`` (see the module). Default: ``'math'``.

    Returns:
        torch.Tensor: Tokens ``(B, height * width, C)`` in ``x``'s dtype.

    Raises:
        ValueError: For another impl, a token count other than ``height * width`` or weights of another shape.
    """
    _check(x, height, width, weight, bias, impl)
    if impl == 'triton':
        from .triton import triton_depthwise_conv_gelu

        return triton_depthwise_conv_gelu(x, height, width, weight, bias)
    batch, _, channels = x.shape
    pre = F.conv2d(x.transpose(1, 2).reshape(batch, channels, height, width), weight, bias, padding=1, groups=channels)
    return F.gelu(pre.flatten(2).transpose(1, 2))


def depthwise_conv_gelu_backward(grad_out, x, height, width, weight, bias, impl='math'):
    """The gradients of :func:`depthwise_conv_gelu`'s ``x``, ``weight`` and ``bias`` for the gradient ``grad_out`` of
    its output (for callers that recompute the forward, such as VVT's conv-FFN). Arguments as there.

    Returns:
        tuple[torch.Tensor, torch.Tensor, torch.Tensor]: The gradients, in the inputs' dtypes.
    """
    _check(x, height, width, weight, bias, impl)
    if impl == 'triton':
        from .triton import triton_depthwise_conv_gelu_backward

        return triton_depthwise_conv_gelu_backward(grad_out, x, height, width, weight, bias)
    with torch.enable_grad():
        x, weight, bias = inputs = [t.detach().requires_grad_() for t in (x, weight, bias)]
        return torch.autograd.grad(depthwise_conv_gelu(x, height, width, weight, bias), inputs, grad_out)


def _check(x, height, width, weight, bias, impl):
    if impl not in IMPLS:
        raise ValueError(f'depthwise_conv_gelu: impl={impl!r}; allowed: {IMPLS}')
    _, tokens, channels = x.shape
    if tokens != height * width:
        raise ValueError(f'depthwise_conv_gelu: {tokens} tokens for a {height}x{width} map ({height * width} tokens)')
    if weight.shape != (channels, 1, 3, 3) or bias is None or bias.shape != (channels,):
        raise ValueError(
            f'depthwise_conv_gelu: a 3x3 depthwise convolution of {channels} channels with a bias takes a weight '
            f'({channels}, 1, 3, 3) and a bias ({channels},), got {tuple(weight.shape)} and '
            f'{None if bias is None else tuple(bias.shape)}'
        )
