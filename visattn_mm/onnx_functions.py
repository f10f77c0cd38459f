"""ONNX translations that torch's exporter gets wrong for these models (needs onnxscript, the deploy extra)."""

from onnxscript import opset18 as op
from onnxscript import script
from onnxscript.onnx_types import INT64


@script()
def floor_divide_sizes(numerator: INT64, denominator: INT64) -> INT64:
    """``numerator // denominator`` of dynamic sizes with Python's floor semantics.

    torch's exporter (2.12) writes ``//`` between sizes as ONNX ``Div``, which truncates:
    the backbones' ceiling divisions ``-(-side // window)`` then come out one short
    wherever the side is no multiple of the window. ``Mod`` (fmod=0) has Python's
    sign, so subtracting it first leaves an exact division.
    """
    return op.Div(op.Sub(numerator, op.Mod(numerator, denominator)), denominator)


def _bin_averages(length, bins, like):
    """``(bins, length)`` weights: row ``i`` averages PyTorch's adaptive-pooling bin ``i`` of ``length`` inputs.

    Bin ``i`` covers ``[floor(i * L / n), ceil((i + 1) * L / n))``; ``length`` is a dynamic
    scalar, ``bins`` a Python int.
    """
    count = op.Constant(value_int=bins)
    # Sizes are non-negative, so Div's truncation is the floor; the ceiling is (a + n - 1) // n.
    start = op.Div(op.Mul(op.Constant(value_ints=list(range(bins))), length), count)
    end = op.Div(
        op.Add(op.Mul(op.Constant(value_ints=list(range(1, bins + 1))), length), op.Constant(value_int=bins - 1)), count
    )
    position = op.Unsqueeze(
        op.Range(op.Constant(value_int=0), length, op.Constant(value_int=1)), op.Constant(value_ints=[0])
    )
    column = op.Constant(value_ints=[1])
    inside = op.And(
        op.GreaterOrEqual(position, op.Unsqueeze(start, column)), op.Less(position, op.Unsqueeze(end, column))
    )
    return op.Div(op.CastLike(inside, like), op.CastLike(op.Unsqueeze(op.Sub(end, start), column), like))


def adaptive_average_pool_2d(images, output_size):
    """``aten._adaptive_avg_pool2d`` for dynamic input sizes, as two matrix products.

    torch's exporter (2.12) decomposes adaptive pooling into gathers whose indices are
    those of the traced size (wrong, or out of range, at any other size: mmseg's pyramid
    pooling in UperNet). Here each output is the mean of its bin, with the bins computed
    from the runtime size.
    """
    out_height, out_width = output_size
    shape = op.Shape(images)
    height = op.Squeeze(op.Slice(shape, op.Constant(value_ints=[2]), op.Constant(value_ints=[3])))
    width = op.Squeeze(op.Slice(shape, op.Constant(value_ints=[3]), op.Constant(value_ints=[4])))
    pooled_width = op.MatMul(images, op.Transpose(_bin_averages(width, out_width, images), perm=[1, 0]))
    return op.MatMul(_bin_averages(height, out_height, images), pooled_width)
