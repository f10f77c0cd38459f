"""Parameters and FLOPs (multiply-adds) of one detection or segmentation config, at a size you name.

Usage::

    python tools/analysis/get_flops.py CONFIG [--shape H [W]] [--cfg-options KEY=VALUE ...] [--device cpu]

The counting is the model zoo's (``tools/analysis/model_zoo.py`` says what is and is not
counted): one random ``H x W`` image through the model's ``mode='tensor'`` forward, multiply-adds
of convolutions and matrix products (attention included). ``--shape`` defaults to the configs'
test sizes: 800x1333 for mmdet configs, 512x512 for mmseg configs.

It stands in for the libraries' own tools where those do not serve our configs: mmdet's
``get_flops.py`` measures dataset images only (it has no ``--shape``), and mmseg 1.2.2's fails on
every config with ``ValueError: "input_shape" and "inputs" cannot be both set``
(open-mmlab/mmsegmentation#3241).
"""

from __future__ import annotations

import argparse

from mmengine.config import DictAction

from visattn_mm.analysis.flops import build_model, count_flops, count_parameters

DEFAULT_SHAPES = {'mmdet': (800, 1333), 'mmseg': (512, 512)}


def parse_shape(values: list[int] | None, scope: str) -> tuple[int, int]:
    """``--shape H`` means ``H x H``; no ``--shape``, the scope's default."""
    if not values:
        return DEFAULT_SHAPES[scope]
    if len(values) > 2 or min(values) < 1:
        raise SystemExit(f'--shape takes H or H W, positive: got {values}')
    return (values[0], values[-1])


def report(params: int, flops: int, parts: dict[str, int], shape: tuple[int, int]) -> str:
    lines = [
        f'Input shape: (3, {shape[0]}, {shape[1]})',
        f'Flops: {flops / 1e9:.2f} G multiply-adds',
        f'Params: {params / 1e6:.2f} M',
    ]
    lines += [f'  {name}: {macs / 1e9:.2f} G' for name, macs in parts.items()]
    return '\n'.join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('config', help='a config file')
    parser.add_argument('--shape', type=int, nargs='+', help='input height [and width]')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction, help='override config settings')
    parser.add_argument('--device', default='cpu', help='where the counted forward runs (same counts)')
    args = parser.parse_args(argv)
    model, scope = build_model(args.config, args.device, args.cfg_options)
    shape = parse_shape(args.shape, scope)
    flops, parts = count_flops(model, scope, *shape)
    print(report(count_parameters(model), flops, parts, shape))


if __name__ == '__main__':
    main()
