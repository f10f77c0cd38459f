"""Export of the backbones, the timm classifiers and whole mmdet / mmseg models out of PyTorch.

Two formats, both with a dynamic batch, height and width (one file serves every size
in the declared range):

* ``torch.export`` programs (``.pt2``, :func:`export_program`), for AOTInductor or
  ``torch.export.load``;
* ONNX (:func:`export_onnx`), written by torch's current (dynamo) exporter from the
  same program, for onnxruntime and TensorRT.

The attention ops are exported on their plain-PyTorch paths ('fast', or 'auto', which
takes 'fast' on the CPU without gradients); the Triton kernels are refused
(:func:`check_exportable`). Whole detectors and segmentors are exported in their
libraries' *tensor mode* (:class:`TensorMode`): the raw head outputs, which the
libraries' own post-processing turns into boxes or label maps.
"""
import operator

import torch
from torch import nn
from torch.export import Dim

from .ops.impl import get_attention_impl

#: Name of the image input of every exported graph.
INPUT_NAME = 'images'


def check_exportable(model):
    """Refuse a model whose attention would run the Triton kernels.

    The Triton ops are custom ops with CUDA kernels that neither ``torch.export``'s
    CPU programs nor ONNX can hold; the same weights export on ``attn_impl='fast'``.

    Raises:
        ValueError: If the process-wide selection or any module's ``attn_impl`` is 'triton'.
    """
    triton = [name or type(model).__name__ for name, module in model.named_modules()
              if getattr(module, 'attn_impl', None) == 'triton']
    if get_attention_impl() == 'triton' or triton:
        where = f'modules {triton[:3]}' if triton else 'the process-wide selection'
        raise ValueError(f"attn_impl='triton' cannot be exported ({where}): its Triton kernels are CUDA "
                         "custom ops that ONNX and CPU programs cannot hold. Build the model with "
                         "attn_impl='fast' (the same weights and outputs) and export that.")


class TensorMode(nn.Module):
    """An mmdet / mmseg model's ``mode='tensor'`` forward, as a flat tuple of tensors.

    mmdet's dense heads return ``(cls_scores, bbox_preds)``, lists over the FPN levels;
    mmseg's EncoderDecoder returns its decode head's logits. Exported graphs need a
    flat output, so the lists are concatenated and :attr:`output_groups` remembers
    how many tensors each group had (see :meth:`regroup`).

    Args:
        model (nn.Module): A built mmdet detector or mmseg segmentor.
    """

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.output_groups = None

    def forward(self, images):
        out = self.model(images, mode='tensor')
        if isinstance(out, torch.Tensor):
            self.output_groups = (1, )
            return (out, )
        groups = [(g, ) if isinstance(g, torch.Tensor) else tuple(g) for g in out]
        self.output_groups = tuple(len(g) for g in groups)
        return tuple(t for g in groups for t in g)

    def regroup(self, flat):
        """``flat`` outputs (of this module or of its exported graph) in the model's own grouping.

        Returns:
            list[list]: one list per output group (e.g. ``[cls_scores, bbox_preds]``).
        """
        if self.output_groups is None:
            raise RuntimeError('TensorMode.regroup needs one forward call first (it learns the grouping)')
        groups, start = [], 0
        for count in self.output_groups:
            groups.append(list(flat[start:start + count]))
            start += count
        return groups


def image_dynamic_shapes(min_side=224, max_side=4096, max_batch=64, side_multiple=1):
    """``dynamic_shapes`` for a graph with one NCHW image input: batch, height and width dynamic.

    Args:
        min_side (int): Smallest height and width the graph accepts. Pale needs every
            stage's map at least one pale wide (193 for pale size 7); other limits come
            from the model (checked when the graph runs).
        max_side (int): Largest height and width.
        max_batch (int): Largest batch.
        side_multiple (int): Sides are multiples of this (e.g. mmdet's ``size_divisor``
            32); 1 accepts every side.

    Returns:
        dict: ``{INPUT_NAME: {0: batch, 2: height, 3: width}}``.
    """
    batch = Dim('batch', min=1, max=max_batch)
    if side_multiple == 1:
        height = Dim('height', min=min_side, max=max_side)
        width = Dim('width', min=min_side, max=max_side)
    else:
        low, high = -(-min_side // side_multiple), max_side // side_multiple
        height = side_multiple * Dim('height_blocks', min=low, max=high)
        width = side_multiple * Dim('width_blocks', min=low, max=high)
    return {INPUT_NAME: {0: batch, 2: height, 3: width}}


class _ImageInput(nn.Module):
    """``model`` called with one positional image batch named :data:`INPUT_NAME` (export names inputs)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images):
        out = self.model(images)
        return (out, ) if isinstance(out, torch.Tensor) else tuple(out)


def export_program(model, example, dynamic_shapes=None):
    """``torch.export`` program of ``model`` in eval mode, without gradients.

    Args:
        model (nn.Module): A backbone, a timm classifier or a :class:`TensorMode`.
        example (Tensor): An NCHW batch to trace with. Its sizes only steer the trace:
            pick them inside the dynamic range, away from 1 and from sizes where a stage
            map is narrower than a window (such sizes specialise the graph).
        dynamic_shapes (dict, optional): See :func:`image_dynamic_shapes` (default: its
            defaults). ``False`` exports a static graph for ``example``'s size.

    Returns:
        torch.export.ExportedProgram: Its outputs are a tuple of tensors.

    Raises:
        ValueError: For a model on the Triton attention path (:func:`check_exportable`).
    """
    check_exportable(model)
    model.eval()
    if dynamic_shapes is None:
        dynamic_shapes = image_dynamic_shapes()
    with torch.no_grad():
        return torch.export.export(_ImageInput(model), (example, ),
                                   dynamic_shapes=dynamic_shapes or None)


def export_onnx(program, path, output_names=None, opset_version=None):
    """Write an exported program as ONNX with torch's dynamo-based exporter.

    The dynamic dimensions of ``program`` stay dynamic in the file.

    Args:
        program (torch.export.ExportedProgram): From :func:`export_program`.
        path (str | Path): The ``.onnx`` file.
        output_names (Sequence[str], optional): Names of the graph outputs.
        opset_version (int, optional): ONNX opset (default: the exporter's).

    Returns:
        torch.onnx.ONNXProgram: The written program.
    """
    from .onnx_functions import floor_divide_sizes

    onnx_program = torch.onnx.export(program, dynamo=True, input_names=[INPUT_NAME],
                                     output_names=list(output_names) if output_names else None,
                                     opset_version=opset_version, verbose=False,
                                     custom_translation_table={operator.floordiv: floor_divide_sizes})
    onnx_program.save(str(path))
    return onnx_program


def onnx_session(path, threads=None):
    """An onnxruntime CPU session for ``path``.

    Args:
        path (str | Path): An ONNX file.
        threads (int, optional): Intra-op threads (default: onnxruntime's choice).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=['CPUExecutionProvider'])


def run_onnx(session, images):
    """Outputs of an onnxruntime session for an NCHW batch, as float32 tensors.

    Args:
        session (onnxruntime.InferenceSession): From :func:`onnx_session`.
        images (Tensor): The input batch (moved to the CPU as float32).

    Returns:
        list[Tensor]: One per graph output.
    """
    feed = {session.get_inputs()[0].name: images.detach().float().cpu().numpy()}
    return [torch.from_numpy(out) for out in session.run(None, feed)]


def max_relative_error(actual, expected):
    """Largest ``|actual - expected|`` over ``max|expected|`` across paired tensors.

    The scale is each tensor's largest magnitude, so that near-zero entries of a map
    do not turn float32 rounding into a large relative error.
    """
    errors = []
    for got, want in zip(actual, expected):
        scale = want.abs().max().clamp_min(torch.finfo(want.dtype).tiny)
        errors.append(((got.to(want.dtype) - want).abs().max() / scale).item())
    return max(errors)
