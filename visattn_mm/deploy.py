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

from .ops.impl import get_attention_impl, resolve_impl

#: Name of the image input of every exported graph.
INPUT_NAME = 'images'


def check_exportable(model):
    """Refuse a model whose attention would run the Triton kernels.

    The Triton ops are custom ops with CUDA kernels that neither ``torch.export``'s
    CPU programs nor ONNX can hold; the same weights export on ``attn_impl='fast'``.

    Raises:
        ValueError: If any module's ``attn_impl`` is 'triton', or 'auto' under a
            process-wide 'triton' selection.
    """
    triton = [
        name or type(model).__name__
        for name, module in model.named_modules()
        if getattr(module, 'attn_impl', None) is not None and resolve_impl(module.attn_impl) == 'triton'
    ]
    if triton:
        where = 'the process-wide selection' if get_attention_impl() == 'triton' else 'its attn_impl'
        raise ValueError(
            f"attn_impl='triton' cannot be exported (modules {triton[:3]}, by {where}): its Triton "
            "kernels are CUDA custom ops that ONNX and CPU programs cannot hold. Build the model with "
            "attn_impl='fast' (the same weights and outputs) and export that."
        )


class TensorMode(nn.Module):
    """The raw tensor outputs of an mmdet / mmseg model, as a flat tuple, and its post-processing.

    * a one-stage detector (RetinaNet): mmdet's ``mode='tensor'``, ``(cls_scores,
      bbox_preds)`` over the FPN levels;
    * a segmentor (UperNet): mmseg's ``mode='tensor'``, the decode head's logits;
    * a two-stage detector (Mask R-CNN): the neck's features and the RPN head's
      ``(cls_scores, bbox_preds)``. mmdet's own tensor mode goes on into the RoI heads,
      whose RoIAlign (an mmcv op) and the RPN's NMS have no ONNX form in this stack;
      :meth:`predict` runs them in PyTorch on the exported features.

    Exported graphs need a flat output, so the groups are concatenated and
    :attr:`output_groups` says how many tensors each group has (:meth:`regroup`).

    Args:
        model (nn.Module): A built mmdet detector or mmseg segmentor.
        output_groups (Sequence[int], optional): The grouping, when the outputs come from
            a graph exported elsewhere (it is saved beside the graph); otherwise learnt
            by the first forward call.
    """

    def __init__(self, model, output_groups=None):
        super().__init__()
        self.model = model
        self.output_groups = tuple(output_groups) if output_groups else None
        self.two_stage = hasattr(model, 'rpn_head') and hasattr(model, 'roi_head')
        if not (self.two_stage or hasattr(model, 'bbox_head') or hasattr(model, 'decode_head')):
            raise TypeError(
                f'TensorMode takes an mmdet detector (bbox_head, or rpn_head and roi_head) or '
                f'an mmseg segmentor (decode_head), not {type(model).__name__}'
            )

    def forward(self, images):
        if self.two_stage:
            features = self.model.extract_feat(images)
            out = (features, *self.model.rpn_head(features))
        else:
            out = self.model(images, mode='tensor')
            if isinstance(out, torch.Tensor):
                out = (out,)
        groups = [(g,) if isinstance(g, torch.Tensor) else tuple(g) for g in out]
        self.output_groups = tuple(len(g) for g in groups)
        return tuple(t for g in groups for t in g)

    def regroup(self, flat):
        """``flat`` outputs (of this module or of its exported graph) in the model's own grouping.

        Returns:
            list[list]: one list per output group (e.g. ``[cls_scores, bbox_preds]``).
        """
        if self.output_groups is None:
            raise RuntimeError(
                'TensorMode.regroup needs the grouping: pass output_groups (saved beside '
                'an exported graph) or call forward once'
            )
        if len(flat) != sum(self.output_groups):
            raise ValueError(
                f'{len(flat)} outputs for the grouping {self.output_groups}: the graph is not of this model'
            )
        groups, start = [], 0
        for count in self.output_groups:
            groups.append(list(flat[start : start + count]))
            start += count
        return groups

    @torch.no_grad()
    def predict(self, flat, data_samples):
        """The library's predictions from the raw outputs, as its ``predict`` would give them.

        Args:
            flat (Sequence[Tensor]): This module's outputs (e.g. from onnxruntime) for the
                batch the data preprocessor made of ``data_samples``.
            data_samples (list): The batch's data samples (their metainfo: image, padding
                and original sizes, scale factors).

        Returns:
            list: ``data_samples`` with ``pred_instances`` (mmdet) or ``pred_sem_seg`` (mmseg).

        Raises:
            ValueError: For an mmseg model that tests with sliding windows (its crops are
                separate graph calls; export for ``mode='whole'``).
        """
        model, groups = self.model, self.regroup(flat)
        metas = [sample.metainfo for sample in data_samples]
        if hasattr(model, 'decode_head'):
            mode = model.test_cfg.get('mode', 'whole')
            if mode != 'whole':
                raise ValueError(
                    f"test_cfg.mode={mode!r}: the exported segmentor serves mode='whole' only "
                    f"(set model.test_cfg.mode='whole')"
                )
            return model.postprocess_result(model.decode_head.predict_by_feat(groups[0][0], metas), data_samples)
        if self.two_stage:
            features, cls_scores, bbox_preds = groups
            proposals = model.rpn_head.predict_by_feat(cls_scores, bbox_preds, batch_img_metas=metas, rescale=False)
            results = model.roi_head.predict(tuple(features), proposals, data_samples, rescale=True)
        else:
            results = model.bbox_head.predict_by_feat(*groups, batch_img_metas=metas, rescale=True)
        return model.add_pred_to_datasample(data_samples, results)


def build_tensor_mode(cfg, checkpoint=None, output_groups=None):
    """The :class:`TensorMode` of a config's model on the exportable attention path, in eval mode.

    The backbone is built with ``attn_impl='fast'`` and without its ``init_cfg`` (the
    weights come from ``checkpoint``, or stay random).

    Args:
        cfg (mmengine.Config): An mmdet or mmseg config; its scope's modules registered
            (e.g. ``mmdet.utils.register_all_modules``).
        checkpoint (str, optional): This model's trained weights, loaded as for evaluation:
            every tensor from the file with its shape, or a refusal naming what differs.
        output_groups (Sequence[int], optional): See :class:`TensorMode`.

    Raises:
        CheckpointError: For a checkpoint that is not this model's.
    """
    import importlib

    from mmengine.registry import init_default_scope

    from .checkpoint import load_model_checkpoint, read_checkpoint

    scope = cfg.get('default_scope')
    init_default_scope(scope)
    model_cfg = cfg.model.copy()
    model_cfg.backbone = dict(model_cfg.backbone, attn_impl='fast', init_cfg=None)
    model = importlib.import_module(f'{scope}.registry').MODELS.build(model_cfg)
    if checkpoint:
        load_model_checkpoint(model, read_checkpoint(checkpoint), str(checkpoint), 'test')
    return TensorMode(model.eval(), output_groups)


def image_dynamic_shapes(min_side=224, max_side=4096, max_batch=64):
    """``dynamic_shapes`` for a graph with one NCHW image input: batch, height and width dynamic.

    The sizes are ``Dim.DYNAMIC`` hints with bounds rather than named ``Dim`` objects: the
    backbones' padding arithmetic makes torch's shape solver meet guards that hold for
    every size in range (a map side is not 1, a stride is not 1) but that it cannot
    prove; named dims turn those into export errors, hints into checks the exported
    program runs on each call. Every size in range passes them; ONNX files carry none.

    Args:
        min_side (int): Smallest height and width the graph accepts. Pale needs every
            stage's map at least one pale wide (193 for pale size 7); other limits come
            from the model (checked when the graph runs).
        max_side (int): Largest height and width.
        max_batch (int): Largest batch.

    Returns:
        dict: ``{INPUT_NAME: {0: batch, 2: height, 3: width}}``.
    """
    side = Dim.DYNAMIC(min=min_side, max=max_side)
    return {INPUT_NAME: {0: Dim.DYNAMIC(min=1, max=max_batch), 2: side, 3: side}}


class _ImageInput(nn.Module):
    """``model`` called with one positional image batch named :data:`INPUT_NAME` (export names inputs)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, images):
        out = self.model(images)
        return (out,) if isinstance(out, torch.Tensor) else tuple(out)


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
        if isinstance(model, TensorMode):
            model(example)  # learns the output grouping; export reverts attributes set while tracing
        return torch.export.export(_ImageInput(model), (example,), dynamic_shapes=dynamic_shapes or None)


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
    from .onnx_functions import adaptive_average_pool_2d, floor_divide_sizes

    translations = {
        operator.floordiv: floor_divide_sizes,
        torch.ops.aten._adaptive_avg_pool2d.default: adaptive_average_pool_2d,
    }
    onnx_program = torch.onnx.export(
        program,
        dynamo=True,
        input_names=[INPUT_NAME],
        output_names=list(output_names) if output_names else None,
        opset_version=opset_version,
        verbose=False,
        custom_translation_table=translations,
    )
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
    do not turn float32 rounding into a large relative error. A single tensor on either
    side counts as one output.
    """
    actual, expected = ([t] if isinstance(t, torch.Tensor) else t for t in (actual, expected))
    if len(actual) != len(expected):
        raise ValueError(f'{len(actual)} outputs against {len(expected)} expected')
    errors = []
    for got, want in zip(actual, expected):
        scale = want.abs().max().clamp_min(torch.finfo(want.dtype).tiny)
        errors.append(((got.to(want.dtype) - want).abs().max() / scale).item())
    return max(errors)
