"""Every backbone traces into one torch.compile graph, on the default and on the Triton path.

The Triton path is checked in Triton's interpreter, in a subprocess (this file run
as a script, see :mod:`triton_harness`): each tiny backbone compiles with
``fullgraph=True`` (any graph break fails) through AOTAutograd, launches the same
kernels as in eager mode, and gives the same outputs and parameter gradients; and
``torch.library.opcheck`` validates each Triton op's schema, fake (shape) function
and autograd formula, with the optional inputs given and absent.
"""

import importlib

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

from helpers import build_tiny
from triton_harness import interpreted_fixture, launch_snapshot, launches_since, main, mismatches
from visattn_mm.models import PaleTransformer, ViL, ViLLS, VVT
from visattn_mm.ops.specs import OP_NAMES

BACKBONES = (ViL, ViLLS, VVT, PaleTransformer)
interpreted = interpreted_fixture()  # the Triton comparisons below, run in the interpreter


@pytest.mark.parametrize('backbone', BACKBONES, ids=lambda c: c.__name__)
def test_tiny_backbone_traces_without_graph_breaks(backbone):
    model = backbone(arch='tiny').train()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(torch.randn(1, 3, 64, 96))
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1


# Image sizes as a multi-scale detection pipeline gives them (sides padded to multiples of 32): the
# second differs from the first in both sides, so that dynamo makes both dynamic at once; the second
# needs padding at every stage and the third none (its quarter-resolution sides are multiples of the
# chunk and pale sizes), which is where a graph that guarded on the padding would compile again. At
# least 320 pixels a side, as a detector's input has: every stage's map then spans two chunks or
# pales (a side of one, dynamo would specialise on).
CHANGING_SIZES = ((320, 384), (352, 416), (448, 448))


def compile_count(cls, training, sizes=CHANGING_SIZES, impl='auto', device='cpu'):
    """How often torch.compile (AOTAutograd, or dynamo alone for inference) compiles a tiny ``cls``
    over ``sizes``: in ``training`` with its backward, else in eval mode without gradients. The
    compiled outputs must equal the eager ones at every size (the general branches that compiled
    code takes compute what eager mode's size-specific ones do)."""
    model = build_tiny(cls, attn_impl=impl, drop_path_rate=0.0).to(device).train(training)
    counter = CompileCounterWithBackend('aot_eager') if training else CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter)
    # On the CPU, PyTorch picks its convolution kernel (mkldnn or not) by the input's size, and
    # dynamo guards on that choice: a tiny model's maps cross that threshold, a detector's do not.
    with torch.backends.mkldnn.flags(enabled=False), torch.set_grad_enabled(training):
        for size in sizes:
            image = torch.randn(1, 3, *size, device=device)
            outs = compiled(image)
            for out, expected in zip(outs, model(image)):
                torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
            if training:
                sum(o.sum() for o in outs).backward()
    return counter.frame_count


@pytest.mark.parametrize('training', (True, False), ids=('train', 'eval'))
@pytest.mark.parametrize('backbone', (ViLLS, VVT, PaleTransformer), ids=lambda c: c.__name__)
def test_compiled_at_most_twice_over_changing_sizes(backbone, training):
    """The first size, then one dynamic graph for every other (ViL-LS's stages 3-4 are ViL's
    sliding-chunk attention, so ViL's ops are counted there)."""
    assert compile_count(backbone, training) <= 2


@pytest.mark.cuda
@pytest.mark.parametrize('training', (True, False), ids=('train', 'eval'))
@pytest.mark.parametrize('backbone', BACKBONES, ids=lambda c: c.__name__)
def test_compiled_at_most_twice_over_changing_sizes_on_cuda(backbone, training):
    """The same on a GPU, on the Triton path."""
    from triton_harness import skip_unless_compiled

    skip_unless_compiled()
    assert compile_count(backbone, training, impl='triton', device='cuda') <= 2


@pytest.mark.parametrize('backbone', BACKBONES, ids=lambda c: c.__name__)
def test_triton_path_compiles_in_one_graph_to_the_eager_numbers(interpreted, backbone):
    result = interpreted[f'compile {backbone.__name__}']
    assert 'error' not in result, result.get('error')
    assert result['launches'], 'the Triton kernels did not run'
    assert result['compiled_launches'] == result['launches']
    assert not result['mismatches'], '\n'.join(result['mismatches'])


@pytest.mark.parametrize('module', OP_NAMES)
def test_triton_ops_pass_opcheck(interpreted, module):
    result = interpreted[f'opcheck {module}']
    assert 'error' not in result, result.get('error')
    assert result['checks'] and set(result['checks']) == {'SUCCESS'}, result['checks']
    assert result['launches'] > 0


@pytest.mark.cuda
@pytest.mark.parametrize('backbone', BACKBONES, ids=lambda c: c.__name__)
def test_triton_path_compiles_with_inductor_on_cuda(backbone):
    """torch.compile's default backend (Inductor) around the Triton ops on a GPU: one graph, and the
    eager outputs and parameter gradients in fp32 within reordered-sum round-off."""
    from triton_harness import skip_unless_compiled

    skip_unless_compiled()
    result = compile_backbone(backbone, device='cuda', dtype=torch.float32, backend='inductor')
    assert result['launches'] and result['compiled_launches'] == result['launches']
    errors = result['relative_errors']
    assert max(errors.values()) < 1e-3, errors


def compile_backbone(cls, device='cpu', dtype=torch.float64, backend='aot_eager'):
    """A tiny ``cls`` on the Triton path, eager and compiled (``fullgraph=True``; AOTAutograd alone
    by default) on ``device`` in ``dtype``: kernel launches of each, the outputs and parameter
    gradients that differ beyond round-off, and the relative error of each."""
    torch.manual_seed(0)
    model = build_tiny(cls, attn_impl='triton', drop_path_rate=0.0).to(device, dtype).train()
    image = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0), dtype=dtype).to(device)
    params = list(model.parameters())

    def run(forward):
        before = launch_snapshot()
        outs = forward(image)
        grads = torch.autograd.grad(sum(o.pow(2).mean() for o in outs), params)
        tensors = {f'output {i}': o for i, o in enumerate(outs)}
        tensors.update((name, g) for (name, _), g in zip(model.named_parameters(), grads))
        return tensors, launches_since(before)

    expected, launches = run(model)
    torch._dynamo.reset()
    actual, compiled_launches = run(torch.compile(model, backend=backend, fullgraph=True))
    # Relative to the tensor, or to a thousandth of the largest one for gradients of rounding noise.
    floor = 1e-3 * max(ref.norm().item() for ref in expected.values())
    errors = {
        label: (actual[label] - ref).norm().item() / max(ref.norm().item(), floor) for label, ref in expected.items()
    }
    return dict(
        launches=launches,
        compiled_launches=compiled_launches,
        relative_errors=errors,
        mismatches=mismatches(actual, expected, rtol=1e-12, atol=1e-12),
    )


def op_arguments(module, full):
    """Tiny float64 arguments of a Triton op of ``module`` (``_..._op``): with every optional input
    (``full``) or with none."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    batch, heads, height, width, dim = 1, 2, 5, 6, 4
    q, k, v = (leaf(batch, heads, height * width, dim) for _ in range(3))
    if module == 'vicinity':
        return q, k, v, height, width, 1e-6, True, False
    if module == 'pale':
        return q, k, v, height, width, 2, 3
    window, num_shared = 3, 2
    shared = [leaf(batch, heads, num_shared, dim) if full else None for _ in range(2)]
    if module == 'sliding_chunk':
        local_bias = leaf(heads, window**2, 9 * window**2) if full else None
        l2g_bias = leaf(heads, num_shared) if full else None
        return q, k, v, *shared, local_bias, l2g_bias, height, width, window, 0, 0
    from visattn_mm.ops.indexing import segment_pad

    span = window + 2 * segment_pad(window)
    local_bias = leaf(heads, window**2, span**2) if full else None
    global_kv = [leaf(batch, heads, 1, dim) if full else None for _ in range(2)]
    return q, k, v, *shared, *global_kv, local_bias, height, width, window


def metadata(tensors):
    return [(tuple(t.shape), t.stride(), t.dtype) for t in tensors]


def fake_metadata_agrees(op, args):
    """Whether ``op``'s fake function gives its outputs' shapes, strides and dtypes (opcheck compares
    shapes but not strides, which compiled code downstream relies on)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    return metadata(real) == metadata(fake)


def opcheck_op(module):
    """``torch.library.opcheck`` of the op of ``module`` with and without its optional inputs, and
    the fake functions' strides of its forward and backward ops: the distinct check results, and
    the kernels launched."""
    op = getattr(importlib.import_module(f'visattn_mm.ops.{module}.triton'), f'_{module}_op')
    backward_op = getattr(torch.ops.visattn_mm, f'triton_{module}_attention_backward')
    before = launch_snapshot()
    checks = set()
    for full in (True, False):
        args = op_arguments(module, full)
        checks.update(torch.library.opcheck(op, args).values())
        tensors = [a for a in args if isinstance(a, torch.Tensor) or a is None]
        outputs = [t.detach() for t in op(*args)]
        backward_args = (
            torch.randn_like(outputs[0]),
            *tensors,
            *outputs,
            *args[len(tensors) :],
            [t is not None for t in tensors],
        )
        checks.update(
            [
                'SUCCESS' if fake_metadata_agrees(f, a) else f'fake strides of {f}'
                for f, a in ((op, args), (backward_op, backward_args))
            ]
        )
    return dict(checks=sorted(checks), launches=sum(launches_since(before).values()))


if __name__ == '__main__':
    # The interpreter subprocess of the ``interpreted`` fixture: one JSON line on stdout.
    main(
        None,
        {},
        **{f'compile {cls.__name__}': lambda cls=cls: compile_backbone(cls) for cls in BACKBONES},
        **{f'opcheck {module}': lambda module=module: opcheck_op(module) for module in OP_NAMES},
    )
