"""The spec table (visattn_mm/ops/specs.py) is the one list of the attention ops: nothing else in the tree
lists them, and every op of it has what docs/design.md ("Adding an attention op") says an op needs."""

import ast
import importlib
from pathlib import Path

import pytest
import torch

from paths import ROOT
from visattn_mm.models import BACKBONES
from visattn_mm.ops.impl import can_run_triton
from visattn_mm.ops.specs import OP_NAMES, OP_SPECS, OPS, op_spec

# Data keyed by op that is not a list of the ops (a test checks its keys against the table).
KEYED_BY_OP = {
    'visattn_mm/ops/kernel_digests.py': 'generated: the digests of the kernels in this tree',
    'tools/analysis/decide_cuda_defaults.py': "recorded: the digests of the kernels that the deciding GPU calls ran",
}


def _strings(nodes):
    return [n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None for n in nodes]


def op_name_lists(source):
    """The lines of ``source`` where a literal lists op names: a tuple, list or set of two or more distinct
    op names and nothing else, no name twice (a per-stage layout repeats them), or a dict whose keys are
    two or more op names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = _strings(node.elts)
        elif isinstance(node, ast.Dict):
            names = _strings([k for k in node.keys if k is not None])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == 'dict':
            names = [k.arg for k in node.keywords]
        else:
            continue
        if len(names) >= 2 and all(n in OPS for n in names) and len(set(names)) == len(names):
            found.append(node.lineno)
    return found


def test_no_list_of_op_names_outside_the_spec_table():
    listed = {}
    for folder in ('visattn_mm', 'tools', 'tests', 'configs'):
        for path in sorted((ROOT / folder).rglob('*.py')):
            relative = path.relative_to(ROOT).as_posix()
            if relative == 'visattn_mm/ops/specs.py':
                continue
            lines = op_name_lists(path.read_text())
            if lines:
                listed[relative] = lines
    assert set(listed) == set(KEYED_BY_OP), (
        'lists of op names outside visattn_mm/ops/specs.py (derive them from OP_SPECS): '
        f'{ {k: v for k, v in listed.items() if k not in KEYED_BY_OP} }'
    )


def test_the_search_finds_the_lists_it_forbids():
    """The search above can fail: it finds the forms the tree used to write."""
    assert op_name_lists("OPS = ('sliding_chunk', 'long_short', 'pale', 'vicinity')") == [1]
    assert op_name_lists("X = dict(sliding_chunk='vil-s', long_short='vil-ls-s')") == [1]
    assert op_name_lists("for op in ['pale', 'vicinity']: pass") == [1]
    assert op_name_lists("LAYOUT = ('long_short', 'long_short', 'sliding_chunk', 'sliding_chunk')") == []
    assert op_name_lists("ATTN = ('sliding_chunk', 'full')") == []


@pytest.mark.parametrize('spec', OP_SPECS, ids=OP_NAMES)
def test_each_op_has_its_parts(spec):
    """The parts docs/design.md's list names: the function, the reference, the Triton module and its
    custom op, a backbone that runs the op and a deciding model of the benchmark's."""
    function = getattr(importlib.import_module(f'visattn_mm.ops.{spec.name}'), f'{spec.name}_attention')
    assert callable(function)
    reference = importlib.import_module(f'visattn_mm.ops.{spec.name}.reference')
    assert callable(getattr(reference, f'{spec.name}_attention_dense'))
    triton_source = Path(ROOT, 'visattn_mm', 'ops', spec.name, 'triton.py').read_text()
    assert f"'triton_{spec.name}_attention'" in triton_source
    assert Path(ROOT, 'tests', 'test_ops', 'test_triton', f'test_triton_{spec.name}.py').exists()
    assert [name for name, cls in BACKBONES.items() if spec in cls.attention_ops]
    from visattn_mm.analysis.benchmark_backbones import MODEL_ZOO

    assert spec.deciding_model in MODEL_ZOO


def test_an_unknown_op_is_named():
    with pytest.raises(ValueError, match=r"unknown attention op 'swin'; the ops are \('sliding_chunk'"):
        op_spec('swin')


@pytest.mark.parametrize(
    ('spec', 'head_dim', 'dtype', 'reason'),
    [
        (OPS['vicinity'], 96, torch.float32, 'head dims up to 64, got 96'),
        (OPS['vicinity'], 48, torch.float64, 'head dims up to 32 in float64, got 48'),
        (OPS['pale'], 96, torch.float32, None),
    ],
)
def test_limits_follow_the_spec(spec, head_dim, dtype, reason):
    q = torch.zeros(1, 1, 4, head_dim, dtype=dtype)
    found = spec.triton_limits.reason(q, None, 0.0, interpreted=False)
    assert found == reason if reason is None else reason in found
    assert can_run_triton(spec.name, q) == (reason is None)
