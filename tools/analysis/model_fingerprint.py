"""Fingerprint every config's model and every timm classifier, to prove a refactor changed nothing.

Usage::

    python tools/analysis/model_fingerprint.py --save before.pt      # on the old code
    python tools/analysis/model_fingerprint.py --compare before.pt   # on the new code

For each distinct model of ``configs/`` (built without ImageNet weights, seed 0) it
records the state-dict keys and shapes, the parameter count and the backbone + neck
features of one fixed 64x96 image in eval mode; for each timm classifier name (at a
tiny custom size for the large ones) the same with logits; and for each backbone the
load report of its classifier's state dict (built at 224, so ViL/ViL-LS full-attention
tables are resized on the way in). ``--compare`` exits 1 and lists every difference;
outputs must be bit-identical. State-dict keys and load reports may differ only by the
documented renaming of VVT's and Pale's numbered layout (``patch_embed{n}``,
``block{n}``, ``norm{n}`` -> ``stages.{n-1}.*``, see ``visattn_mm.models.base``): old
keys are compared under the names that renaming gives them.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
IMAGE = (64, 96)


def config_models():
    """(config name, model config) of every distinct model in configs/."""
    from mmengine.config import Config

    seen, out = {}, []
    for path in sorted((ROOT / 'configs').glob('*.py')):
        cfg = Config.fromfile(str(path))
        model_cfg = copy.deepcopy(cfg.model)
        model_cfg.backbone.init_cfg = None
        key = repr(model_cfg.to_dict())
        if key not in seen:
            seen[key] = path.stem
            out.append((path.stem, cfg.default_scope, model_cfg))
    return out


def state_summary(model):
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()], sum(p.numel() for p in model.parameters())


def fingerprint_configs(entry):
    from mmengine.registry import init_default_scope

    for name, scope, model_cfg in config_models():
        init_default_scope(scope)
        registry = importlib.import_module(f'{scope}.registry').MODELS
        torch.manual_seed(0)
        model = registry.build(model_cfg).eval()
        keys, params = state_summary(model)
        torch.manual_seed(1)
        image = torch.randn(1, 3, *IMAGE)
        with torch.no_grad():
            feats = model.extract_feat(image)
        entry[f'config/{name}'] = dict(
            keys=keys,
            params=params,
            outputs=[f.clone() for f in feats],
            backbone=type(model.backbone).__name__,
            prefix='backbone.',
        )
        print(f'{name}: {params} parameters, {len(keys)} tensors', flush=True)


def fingerprint_classifiers(entry):
    import timm

    import visattn_mm  # noqa: F401  (registers the names)
    from visattn_mm.checkpoint import load_pretrained
    from visattn_mm.models import BACKBONES
    from visattn_mm.timm_models import VARIANTS

    for name in VARIANTS:
        torch.manual_seed(0)
        model = timm.create_model(name, num_classes=10).eval()
        keys, params = state_summary(model)
        torch.manual_seed(1)
        image = torch.randn(1, 3, *IMAGE)
        with torch.no_grad():
            logits = model(image)
        entry[f'timm/{name}'] = dict(
            keys=keys, params=params, outputs=[logits], backbone=VARIANTS[name][0], prefix='backbone.'
        )
        print(f'{name}: {params} parameters', flush=True)
        if name.endswith('_tiny'):
            dense = BACKBONES[VARIANTS[name][0]]
            torch.manual_seed(2)
            backbone = dense(arch='tiny').eval()
            report = load_pretrained(backbone, {'state_dict': model.state_dict()}, source=name)
            with torch.no_grad():
                outputs = backbone(image)
            entry[f'load/{name}'] = dict(
                keys=state_summary(backbone)[0],
                params=report.summary(),
                outputs=list(outputs),
                backbone=VARIANTS[name][0],
                prefix='',
            )


def renamed_as_documented(old, new):
    """Fingerprint ``old``'s keys and load report under the names the documented renaming gives
    them, for the backbone and prefix recorded in ``new`` (an old fingerprint may lack them).

    Returns:
        tuple: The keys ((name, shape) pairs; sorted if any was renamed, as the renaming also
        moved Pale's output norms after its stages), the load report or parameter count, and
        whether any key was renamed.
    """
    from visattn_mm.models import BACKBONES
    from visattn_mm.models.base import rename_numbered_stage_keys, renamed_numbered_key

    shapes = dict(old['keys'])
    layout = BACKBONES[new['backbone']].numbered_layout if 'backbone' in new else {}
    rename_numbered_stage_keys(shapes, layout, new.get('prefix', ''))
    if list(shapes) == [key for key, _ in old['keys']]:
        return old['keys'], old['params'], False
    params = old['params']
    if isinstance(params, str):  # a load report: rename the keys it lists
        params = re.sub(
            r'(?<![\w.])(?:patch_embed|block|norm)\d+\.[\w.]+',
            lambda m: renamed_numbered_key(m.group(), layout) or m.group(),
            params,
        )
    return sorted(shapes.items()), params, True


def compare(before, after):
    problems = []
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            problems.append(f'{name}: only in {"after" if name in after else "before"}')
            continue
        old, new = before[name], after[name]
        old_keys, old_params, renamed = renamed_as_documented(old, new)
        if old_keys != (sorted(new['keys']) if renamed else new['keys']):
            problems.append(f'{name}: state-dict keys or shapes differ')
        if old_params != new['params']:
            problems.append(f'{name}: parameter count / load report differs:\n{old["params"]}\n{new["params"]}')
        if len(old['outputs']) != len(new['outputs']):
            problems.append(f'{name}: {len(old["outputs"])} outputs before, {len(new["outputs"])} after')
        for i, (a, b) in enumerate(zip(old['outputs'], new['outputs'])):
            if a.shape != b.shape or not torch.equal(a, b):
                diff = (a - b).abs().max().item() if a.shape == b.shape else 'shape'
                problems.append(f'{name}: output {i} differs (max abs diff {diff})')
    return problems


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument('--save', metavar='FILE', help='write the fingerprint of the current code')
    action.add_argument('--compare', metavar='FILE', help='compare the current code with a saved fingerprint')
    args = parser.parse_args(argv)
    entry = {}
    fingerprint_classifiers(entry)
    fingerprint_configs(entry)
    if args.save:
        torch.save(entry, args.save)
        print(f'saved {len(entry)} fingerprints to {args.save}')
        return 0
    problems = compare(torch.load(args.compare, weights_only=False), entry)
    print(
        '\n'.join(problems)
        if problems
        else f'identical: {len(entry)} fingerprints (keys, shapes, parameter counts, load reports, outputs bit for bit)'
    )
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
