"""Export a backbone, a timm classifier or a whole mmdet / mmseg model to ``.pt2`` and ONNX.

Usage::

    # a dense backbone (random weights, or --checkpoint)
    python tools/deploy/export.py backbone ViL --arch tiny --out-dir work_dirs/deploy
    # a timm classifier
    python tools/deploy/export.py timm vil_tiny --out-dir work_dirs/deploy
    # a whole RetinaNet / UperNet in the library's tensor mode (raw head outputs); Mask R-CNN
    # up to its RPN head (the rest runs in PyTorch, docs/deploy.md); evaluate with evaluate.py
    python tools/deploy/export.py config configs/retinanet_vil_t_1x.py --checkpoint CKPT \\
        --out-dir work_dirs/deploy

Writes ``NAME.pt2`` (``torch.export``) and ``NAME.onnx`` (torch's dynamo exporter),
both with a dynamic batch, height and width in ``[--min-side, --max-side]``, then runs
the ONNX file in onnxruntime (CPU) at each ``--check-size`` and prints its largest
relative difference to eager PyTorch (exit status 1 above ``--tolerance``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mmengine.config import DictAction

from visattn_mm import cli as common


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description='Export a visattn_mm model to .pt2 and ONNX')
    parser.add_argument(
        'kind',
        choices=('backbone', 'timm', 'config'),
        help='backbone: a registered backbone type; timm: a timm model name; '
        'config: an mmdet/mmseg config, exported in tensor mode',
    )
    parser.add_argument('target', help='backbone type (ViL, ViLLS, VVT, PaleTransformer), timm name, or config file')
    parser.add_argument('--arch', default='tiny', help='backbone arch (kind backbone). Default: tiny')
    parser.add_argument(
        '--checkpoint',
        help="weights to load (default: random init); kind config: the "
        "model's own checkpoint, loaded exactly as tools/test.py does",
    )
    parser.add_argument('--out-dir', default='work_dirs/deploy')
    parser.add_argument('--name', help='file stem (default: from the target)')
    parser.add_argument(
        '--example-size',
        type=int,
        nargs=2,
        default=(480, 640),
        metavar=('H', 'W'),
        help='size traced with (inside the range, no stage map narrower than a window). Default: 480 640',
    )
    parser.add_argument('--batch', type=int, default=2, help='batch traced with (not 1). Default: 2')
    parser.add_argument('--min-side', type=int, default=224)
    parser.add_argument('--max-side', type=int, default=2048)
    parser.add_argument('--static', action='store_true', help='export for --example-size only')
    parser.add_argument(
        '--check-size',
        type=int,
        nargs=2,
        action='append',
        metavar=('H', 'W'),
        help='onnxruntime vs eager at this size (repeatable). Default: the example size',
    )
    parser.add_argument(
        '--tolerance',
        type=float,
        default=1e-4,
        help='largest relative difference accepted at the check sizes. Default: 1e-4',
    )
    parser.add_argument('--no-onnx', action='store_true', help='write only the .pt2 program')
    parser.add_argument(
        '--cfg-options', nargs='+', action=DictAction, help='config overrides (kind config), as in tools/test.py'
    )
    return parser.parse_args(argv)


def build_model(args):
    """The model to export (eval mode, ``attn_impl='fast'``, weights of ``--checkpoint``) and its file stem."""
    common.import_plugin()
    from visattn_mm.checkpoint import load_pretrained

    if args.kind == 'config':
        from visattn_mm.deploy import build_tensor_mode

        cfg = common.load_config(args.target, args.cfg_options, 'none')
        common.register_scope_modules(cfg)
        return build_tensor_mode(cfg, args.checkpoint), args.name or Path(args.target).stem
    if args.kind == 'backbone':
        from mmdet.registry import MODELS

        model = MODELS.build(dict(type=args.target, arch=args.arch, attn_impl='fast'))
        name = f'{args.target}_{args.arch}'
    else:
        import timm

        model = timm.create_model(args.target, attn_impl='fast')
        name = args.target
    if args.checkpoint:
        load_pretrained(model, args.checkpoint)
    return model.eval(), args.name or name


def main(argv=None) -> int:
    args = parse_args(argv)
    model, name = build_model(args)
    import torch

    from visattn_mm import deploy

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    example = torch.randn(args.batch, 3, *args.example_size)
    shapes = False if args.static else deploy.image_dynamic_shapes(args.min_side, args.max_side)
    program = deploy.export_program(model, example, shapes)
    torch.export.save(program, out_dir / f'{name}.pt2')
    report = dict(pt2=str(out_dir / f'{name}.pt2'), range_constraints=str(program.range_constraints))
    # The image sides the graph serves (tools/deploy/evaluate.py refuses others).
    if args.static:
        report['input_size'] = list(args.example_size)
    else:
        report['input_sides'] = dict(min=args.min_side, max=args.max_side)
    if isinstance(model, deploy.TensorMode):
        # tools/deploy/evaluate.py regroups the graph's flat outputs with this.
        report['output_groups'] = list(model.output_groups)
    print(f'wrote {report["pt2"]}')
    if not args.no_onnx:
        onnx_path = out_dir / f'{name}.onnx'
        deploy.export_onnx(program, onnx_path)
        report['onnx'] = str(onnx_path)
        print(f'wrote {onnx_path}')
        session = deploy.onnx_session(onnx_path)
        report['checks'] = []
        for size in args.check_size or [args.example_size]:
            images = torch.randn(1, 3, *size)
            with torch.no_grad():
                expected = deploy._ImageInput(model)(images)
            error = deploy.max_relative_error(deploy.run_onnx(session, images), expected)
            report['checks'].append(dict(size=list(size), max_relative_error=error))
            print(f'onnxruntime vs eager at {size[0]}x{size[1]}: max relative error {error:.2e}')
    (out_dir / f'{name}.json').write_text(json.dumps(report, indent=2))
    worst = max((c['max_relative_error'] for c in report.get('checks', [])), default=0.0)
    return 1 if worst > args.tolerance else 0


if __name__ == '__main__':
    sys.exit(main())
