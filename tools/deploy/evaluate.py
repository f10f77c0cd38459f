"""Evaluate an exported RetinaNet / Mask R-CNN / UperNet on a config's test set through onnxruntime.

Usage::

    python tools/deploy/export.py config CONFIG --checkpoint CKPT --out-dir DIR
    python tools/deploy/evaluate.py CONFIG DIR/NAME.onnx --checkpoint CKPT [--eager]

Each test batch goes through the config's data preprocessor, the ONNX graph (onnxruntime,
CPU) and then mmdet's / mmseg's own post-processing (:meth:`visattn_mm.deploy.TensorMode.predict`:
box decoding and NMS, Mask R-CNN's RoI heads, mmseg's resizing) and the config's test
evaluator. ``--eager`` evaluates the same checkpoint in PyTorch too and exits with
status 1 if any metric differs (the evaluators report 3 decimals for COCO AP, 2 for mIoU).
The checkpoint loads as in ``tools/test.py``: every tensor of the model from the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmengine.config import DictAction

from visattn_mm import cli as common


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Evaluate an exported model with its library's evaluator")
    parser.add_argument('config', help='the mmdet / mmseg config the graph was exported from')
    parser.add_argument('onnx', help="the .onnx file of tools/deploy/export.py (its .json beside it)")
    parser.add_argument(
        '--checkpoint', required=True, help='the weights that were exported (the post-processing heads read them too)'
    )
    parser.add_argument(
        '--eager',
        action='store_true',
        help='evaluate the checkpoint in eager PyTorch as well; exit 1 if a metric differs',
    )
    parser.add_argument('--threads', type=int, help="onnxruntime intra-op threads (default: onnxruntime's)")
    parser.add_argument('--out', help='JSON file for the metrics')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction, help='config overrides, as given to tools/deploy/export.py'
    )
    parser.add_argument(
        '--allow-outside-range',
        action='store_true',
        help='run test images whose padded sides the export did not declare (warned once per size); '
        'by default they are refused',
    )
    return parser.parse_args(argv)


def outside_exported_range(size, graph_info):
    """Why an input of padded ``size`` (H, W) is outside what the graph was exported for, or None.

    Args:
        size (tuple[int, int]): The batch's padded height and width.
        graph_info (dict): The ``.json`` that tools/deploy/export.py writes beside the graph: ``input_sides``
            (``min``, ``max``) of a dynamic export, ``input_size`` of a static one (files without either
            are not checked).
    """
    if 'input_size' in graph_info and list(size) != list(graph_info['input_size']):
        return f'the graph was exported for {graph_info["input_size"]} only (--static); this batch is {list(size)}'
    sides = graph_info.get('input_sides')
    if sides and not all(sides['min'] <= side <= sides['max'] for side in size):
        return (
            f'this batch is {size[0]}x{size[1]}, outside the sides [{sides["min"]}, {sides["max"]}] the graph was '
            'exported for'
        )
    return None


def outside_range_message(size, graph_info, allow_outside_range):
    """The line for a batch of padded ``size`` outside the exported range: an error with the fix, or,
    with ``--allow-outside-range`` given, a warning that says it runs anyway; None inside the range.

    Args:
        size (tuple[int, int]): The batch's padded height and width.
        graph_info (dict): The export's ``.json`` (see :func:`outside_exported_range`).
        allow_outside_range (bool): Whether ``--allow-outside-range`` was passed.
    """
    problem = outside_exported_range(size, graph_info)
    if problem is None:
        return None
    if allow_outside_range:
        return f'warning: {problem}; run anyway (--allow-outside-range)'
    export_fix = 'export at this size' if 'input_size' in graph_info else 'export with other --min-side / --max-side'
    return f'error: {problem}; {export_fix}, or pass --allow-outside-range'


def evaluate(cfg, tensor_mode, session, eager=False, graph_info=None, allow_outside_range=False):
    """The config's test metrics of the exported graph (and of the eager model, with ``eager``).

    Args:
        graph_info (dict, optional): The export's ``.json``: batches outside the sides it declares are
            refused (SystemExit), or warned about once per size with ``allow_outside_range``.

    Returns:
        tuple: ``({'onnxruntime': metrics[, 'eager': metrics]}, largest relative difference
        of the graph's raw outputs to the eager ones, or None without ``eager``)``.
    """
    import copy

    import torch
    from mmengine.evaluator import Evaluator
    from mmengine.runner import Runner

    from visattn_mm import deploy

    loader = Runner.build_dataloader(cfg.test_dataloader)
    evaluators = {name: Evaluator(cfg.test_evaluator) for name in ('onnxruntime', 'eager')[: 1 + eager]}
    for evaluator in evaluators.values():
        evaluator.dataset_meta = loader.dataset.metainfo
    model, worst, warned = tensor_mode.model, None, set()
    for batch in loader:
        with torch.no_grad():
            data = model.data_preprocessor(batch, False)
            images, samples = data['inputs'], data['data_samples']
            size = tuple(images.shape[-2:])
            message = outside_range_message(size, graph_info or {}, allow_outside_range)
            if message and not allow_outside_range:
                raise SystemExit(message)
            if message and size not in warned:
                warned.add(size)
                print(message, flush=True)
            outputs = deploy.run_onnx(session, images)
            if eager:
                error = deploy.max_relative_error(outputs, tensor_mode(images))
                worst = error if worst is None else max(worst, error)
                # The library's own predict, independent of TensorMode.predict.
                evaluators['eager'].process(
                    data_samples=model.predict(images, copy.deepcopy(samples)), data_batch=batch
                )
            evaluators['onnxruntime'].process(data_samples=tensor_mode.predict(outputs, samples), data_batch=batch)
    metrics = {name: evaluator.evaluate(len(loader.dataset)) for name, evaluator in evaluators.items()}
    # mmseg's metrics are numpy scalars.
    return {name: {key: float(value) for key, value in values.items()} for name, values in metrics.items()}, worst


def main(argv=None) -> int:
    args = parse_args(argv)
    common.import_plugin()
    from visattn_mm import deploy

    cfg = common.load_config(args.config, args.cfg_options, 'none')
    common.register_scope_modules(cfg)
    graph_info = Path(args.onnx).with_suffix('.json')
    if not graph_info.exists():
        raise SystemExit(
            f'{graph_info} not found: export with tools/deploy/export.py config, which writes it '
            f'beside the .onnx file (it holds how the graph output groups)'
        )
    info = json.loads(graph_info.read_text())
    groups = info.get('output_groups')
    if not groups:
        raise SystemExit(
            f'{graph_info} has no output_groups: {args.onnx} is not a whole model exported with '
            f'tools/deploy/export.py config'
        )
    with common.exit_on_checkpoint_error():
        tensor_mode = deploy.build_tensor_mode(cfg, args.checkpoint, groups)
    session = deploy.onnx_session(args.onnx, args.threads)
    metrics, worst = evaluate(cfg, tensor_mode, session, args.eager, info, args.allow_outside_range)
    for name, values in metrics.items():
        print(f'{name}: ' + ', '.join(f'{key}: {value}' for key, value in values.items()))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(metrics, max_relative_error=worst), indent=2))
    if not args.eager:
        return 0
    print(f'raw outputs, onnxruntime vs eager: max relative difference {worst:.2e}')
    differing = {
        key: (value, metrics['eager'].get(key))
        for key, value in metrics['onnxruntime'].items()
        if value != metrics['eager'].get(key)
    }
    if differing:
        print(f'onnxruntime and eager differ in {len(differing)} metrics (onnxruntime, eager): {differing}')
        return 1
    print(f'onnxruntime equals eager in all {len(metrics["eager"])} metrics')
    return 0


if __name__ == '__main__':
    sys.exit(main())
