"""Dump every config's resolved dict, to prove a config refactor changed nothing the Runner reads.

Usage::

    python tools/analysis/config_dump.py --save before.pkl --configs /tmp/before/configs   # the old tree
    python tools/analysis/config_dump.py --compare before.pkl                               # this tree

Every config below ``configs/`` (``_base_/`` excepted, ``demo/`` included) is loaded with
``Config.fromfile`` and recorded as ``to_dict()``. ``--compare`` walks the old and the new
dicts key by key and lists every value that differs, every key that is gone and every key
that is new, by its path (``maskrcnn_vil_b_1x.py: optim_wrapper.optimizer.lr: 8e-05 -> 0.0001``).
A refactor may add top-level tables that final configs read (a base's ``sizes``); name each
with ``--new-table NAME``: it is then listed once, not as a difference. Exits 1 on any
difference.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dump_configs(config_dir):
    """``{path relative to config_dir: Config.fromfile(path).to_dict()}`` for every final config.

    Args:
        config_dir (str | Path): A ``configs/`` folder; its ``_base_/`` files are left out.
    """
    from mmengine.config import Config

    config_dir = Path(config_dir)
    paths = sorted(p for p in config_dir.rglob('*.py') if '_base_' not in p.relative_to(config_dir).parts)
    return {str(p.relative_to(config_dir)): Config.fromfile(str(p)).to_dict() for p in paths}


def differences(before, after, path=''):
    """Every difference between two resolved values, as ``'path: what'`` lines (empty if equal).

    Dicts are compared key by key and lists item by item, so a difference names the leaf it is
    in; values of other types compare with ``==`` and their types (``1`` is not ``1.0``, nor a
    tuple a list).

    Args:
        before: A value of the old dump.
        after: The value at the same place in the new dump.
        path (str): Where they are (``optim_wrapper.optimizer``), for the lines.
    """
    if isinstance(before, dict) and isinstance(after, dict):
        lines = []
        for key in list(before) + [key for key in after if key not in before]:
            inner = f'{path}.{key}' if path else str(key)
            if key not in after:
                lines.append(f'{inner}: only before')
            elif key not in before:
                lines.append(f'{inner}: only after')
            else:
                lines += differences(before[key], after[key], inner)
        return lines
    if isinstance(before, (list, tuple)) and type(before) is type(after) and len(before) == len(after):
        return [line for i, (a, b) in enumerate(zip(before, after)) for line in differences(a, b, f'{path}[{i}]')]
    if type(before) is not type(after) or before != after:
        return [f'{path}: {before!r} -> {after!r}']
    return []


def compare(before, after, new_tables=()):
    """``(problems, notes)``: the differences between two dumps, and the named new tables where they appear.

    Args:
        before (dict): A dump of :func:`dump_configs`, of the old tree.
        after (dict): Of the new tree.
        new_tables (Iterable[str]): Top-level keys the new tree may add (tables final configs read).

    Returns:
        tuple: ``problems``, one line per difference (config and key path); ``notes``, one line per
        accepted new table with the number of configs that have it.
    """
    problems, seen = [], {}
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            problems.append(f'{name}: only in {"after" if name in after else "before"}')
            continue
        for table in new_tables:
            if table in after[name] and table not in before[name]:
                seen[table] = seen.get(table, 0) + 1
        new = {key: value for key, value in after[name].items() if key in before[name] or key not in new_tables}
        problems += [f'{name}: {line}' for line in differences(before[name], new)]
    notes = [f'new table {table!r} in {count} configs' for table, count in seen.items()]
    return problems, notes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument('--save', metavar='FILE', help='write the dump of the configs')
    action.add_argument('--compare', metavar='FILE', help='compare the configs with a saved dump')
    parser.add_argument(
        '--configs', metavar='DIR', default=str(ROOT / 'configs'), help='the configs folder (default: this tree\'s)'
    )
    parser.add_argument(
        '--new-table',
        metavar='NAME',
        action='append',
        default=[],
        help='a top-level key the new configs may add (repeatable)',
    )
    args = parser.parse_args(argv)
    dump = dump_configs(args.configs)
    if args.save:
        Path(args.save).write_bytes(pickle.dumps(dump))
        print(f'saved {len(dump)} configs to {args.save}')
        return 0
    problems, notes = compare(pickle.loads(Path(args.compare).read_bytes()), dump, args.new_table)
    print(
        '\n'.join(problems + notes)
        if problems
        else '\n'.join([f'identical: {len(dump)} configs (every key of the saved dump)', *notes])
    )
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
