"""Write ``model-index.yml``, the catalogue that ``mim search visattn_mm`` reads.

One entry per config in ``configs/`` (not ``_base_/``), described from its file name,
which follows ``{maskrcnn|retinanet}_{backbone}_{size}_{1x|3x_ms}.py`` and
``upernet_{backbone}_{size}_160k_ade20k.py``; a config named otherwise is an error, so
that a new config cannot be left out silently. There are no result or weight fields:
no config has been trained on COCO / ADE20K here (paper numbers are in
``docs/model_zoo.md``, labelled as such).

Usage: ``python tools/make_model_index.py`` (rewrites the file), or ``--check`` (exit 1
if the file is not what this script writes; ``tests/test_install.py`` runs it).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INDEX = ROOT / 'model-index.yml'

# backbone key in config names -> (collection, paper title, paper); mim shows the paper field
# as it is, so it is the address, and the title goes into a comment.
COLLECTIONS = {
    'vil': (
        'ViL',
        'Multi-Scale Vision Longformer: A New Vision Transformer for High-Resolution Image Encoding',
        'https://arxiv.org/abs/2103.15358',
    ),
    'vil_ls': (
        'ViL-LS',
        'Long-Short Transformer: Efficient Transformers for Language and Vision',
        'https://arxiv.org/abs/2107.02192',
    ),
    'vvt': ('VVT', 'Vicinity Vision Transformer', 'https://arxiv.org/abs/2206.10552'),
    'pale': (
        'Pale',
        'Pale Transformer: A General Vision Transformer Backbone with Pale-Shaped Attention',
        'https://arxiv.org/abs/2112.14000',
    ),
}
DETECTORS = {'maskrcnn': 'Mask R-CNN', 'retinanet': 'RetinaNet'}
DETECTION = re.compile(
    r'(?P<head>maskrcnn|retinanet)_(?P<backbone>vil_ls|vil|vvt|pale)_'
    r'(?P<size>[tsmbl])_(?P<schedule>1x|3x_ms)'
)
SEGMENTATION = re.compile(r'upernet_(?P<backbone>vil_ls|vil|vvt|pale)_(?P<size>[tsmbl])_160k_ade20k')
TOY = {
    'maskrcnn_vil_t_toy': dict(
        backbone='vil', architecture=['Mask R-CNN', 'FPN'], data='toy COCO (tools/make_toy_data.py)', iterations=150
    )
}


def describe(config: Path) -> str:
    """The model-index entry of one config, from its name.

    Args:
        config: path of the config, relative to the repository root.

    Raises:
        ValueError: the name follows none of the known patterns.
    """
    name = config.stem
    if found := DETECTION.fullmatch(name):
        architecture = DETECTORS[found['head']]
        fields = dict(
            backbone=found['backbone'],
            architecture=[architecture, 'FPN'],
            data='COCO',
            epochs=36 if found['schedule'] == '3x_ms' else 12,
        )
    elif found := SEGMENTATION.fullmatch(name):
        fields = dict(backbone=found['backbone'], architecture=['UperNet'], data='ADE20K', iterations=160000)
    elif name in TOY:
        fields = dict(TOY[name])
    else:
        raise ValueError(
            f'{config}: name follows no pattern of tools/make_model_index.py; rename it or teach the script its fields'
        )
    collection = COLLECTIONS[fields['backbone']][0]
    lines = [
        f'  - Name: {name}',
        f'    In Collection: {collection}',
        f'    Config: {config.as_posix()}',
        '    Metadata:',
        f'      Training Data: {fields["data"]}',
    ]
    lines += (
        [f'      Epochs: {fields["epochs"]}'] if 'epochs' in fields else [f'      Iterations: {fields["iterations"]}']
    )
    lines += ['      Architecture:'] + [f'        - {part}' for part in fields['architecture'] + [collection]]
    return '\n'.join(lines)


def render(configs_dir: Path = ROOT / 'configs') -> str:
    """The text of ``model-index.yml`` for the configs under ``configs_dir``."""
    lines = ['# Written by tools/make_model_index.py; do not edit by hand.', 'Collections:']
    for collection, title, url in COLLECTIONS.values():
        lines += [f'  - Name: {collection}', f'    Paper: {url}  # {title}', '    README: docs/model_zoo.md']
    lines.append('Models:')
    configs = sorted(p.relative_to(configs_dir.parent) for p in configs_dir.rglob('*.py') if '_base_' not in p.parts)
    lines += [describe(config) for config in configs]
    return '\n'.join(lines) + '\n'


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--check', action='store_true', help='compare instead of writing; exit 1 if the file is stale')
    args = parser.parse_args()
    text = render()
    if args.check:
        if not INDEX.is_file() or INDEX.read_text() != text:
            print(f'{INDEX.name} is stale: run python tools/make_model_index.py', file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(text)
    print(f'wrote {INDEX} ({text.count("  - Name:") - len(COLLECTIONS)} models)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
