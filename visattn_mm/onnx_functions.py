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
