"""The Triton kernels of the conv-FFN's depthwise convolution + GELU (``visattn_mm.ops.conv_gelu``) against the
math path, and VVT's ``fused_conv_gelu`` that runs them.

As in ``test_triton_sliding_chunk.py``: the CPU comparisons run in Triton's interpreter, in a subprocess
(this file run as a script, see :mod:`triton_harness`); every case compares, in float64, the output and the
gradients of the tokens, the weight and the bias with the math path (torch's convolution and GELU), and
counts the launches of each kernel.
"""

import pytest
import torch

from helpers import build_tiny
from tool_runs import _load_tool
from triton_harness import (
    CUDA_DTYPE_IDS,
    CUDA_DTYPES,
    assert_cuda_deterministic,
    assert_fp16_within_tolerance,
    assert_kernels_matched,
    compare_backbone,
    compiling_launches,
    interpreted_fixture,
    launch_snapshot,
    launches_since,
    low_precision_errors,
    main,
    mismatches,
    set_interpreted,
    skip_unless_compiled,
)
from visattn_mm.models import VVT
from visattn_mm.ops.conv_gelu import depthwise_conv_gelu

MODULE = 'visattn_mm.ops.conv_gelu.triton'
FORWARD, BACKWARD_PRE, BACKWARD_INPUT = '_conv_gelu_forward', '_conv_gelu_backward_pre', '_conv_gelu_backward_input'
KERNELS = (FORWARD, BACKWARD_PRE, BACKWARD_INPUT)
interpreted = interpreted_fixture()  # the comparisons below, run in the interpreter

# name: (batch, H, W, channels). Programs take 32 tokens and at most 64 channels: maps of more than 32
# tokens and more than 64 channels run several tiles of each, the last one partly outside. 'strided' takes
# the tokens as a view of every other channel of a wider tensor.
CASES = {
    'odd-non-square': (2, 5, 7, 3),
    'one-pixel': (1, 1, 1, 20),
    'one-row': (2, 1, 6, 4),
    'one-column': (1, 7, 1, 4),
    'several-token-tiles': (1, 8, 9, 5),
    'several-channel-tiles': (2, 4, 3, 70),
    'strided': (2, 4, 5, 6),
}
STRIDED = {'strided'}


def case_inputs(name, dtype, device='cpu', seed=0):
    """Leaf tensors of a case and the op on them: ``(leaves, op)``, ``op(impl)`` the output."""
    batch, height, width, channels = CASES[name]
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(device).requires_grad_()

    tokens = leaf(batch, height * width, 2 * channels if name in STRIDED else channels)
    weight, bias = leaf(channels, 1, 3, 3), leaf(channels)
    x = tokens[..., ::2] if name in STRIDED else tokens

    def op(impl):
        return depthwise_conv_gelu(x, height, width, weight, bias, impl=impl)

    return [tokens, weight, bias], op


@pytest.mark.parametrize('name', CASES)
def test_interpreted_kernels_match_math(name, interpreted):
    assert_kernels_matched(interpreted[name], dict.fromkeys(KERNELS, 1))


def test_vvt_fused_conv_gelu_runs_the_kernels_and_computes_what_it_did(interpreted):
    """VVT(fused_conv_gelu=True), tiny (one block per stage): with gradients each conv-FFN runs the forward kernel
    twice (forward, and again in backward for fc2's weight gradient, keeping only its input) and each backward
    kernel once; without, the forward kernel once. Outputs and every parameter gradient equal the unfused
    model's in float64."""
    result = interpreted['vvt']
    assert_kernels_matched(result, {FORWARD: 8, BACKWARD_PRE: 4, BACKWARD_INPUT: 4})
    assert result['evaluation_launches'] == {FORWARD: 4}


def compare_compiled():
    """A tiny VVT with fused_conv_gelu=True under torch.compile (AOTAutograd, eager backend; interpreter subprocess):
    graphs and graph breaks, the kernel launches, and the outputs and parameter gradients against eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = build_tiny(VVT, fused_conv_gelu=True, drop_path_rate=0.0).double().train()
    image = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    counter = CompileCounterWithBackend('aot_eager')
    torch._dynamo.reset()
    results = {}
    for label, run in (('eager', model), ('compiled', torch.compile(model, backend=counter))):
        before = launch_snapshot()
        outs = run(image)
        grads = torch.autograd.grad(sum(o.pow(2).mean() for o in outs), list(model.parameters()))
        tensors = {f'output {i}': o for i, o in enumerate(outs)}
        tensors.update((name, g) for (name, _), g in zip(model.named_parameters(), grads))
        results[label] = tensors, launches_since(before)
    return dict(
        graphs=counter.frame_count,
        graph_breaks=torch._dynamo.explain(model)(image).graph_break_count,
        launches=results['compiled'][1],
        eager_launches=results['eager'][1],
        mismatches=mismatches(results['compiled'][0], results['eager'][0], rtol=1e-12, atol=1e-12),
    )


def test_vvt_fused_conv_gelu_compiles_in_one_graph_to_the_eager_numbers(interpreted):
    """The kernels are custom ops inside an autograd function: torch.compile keeps them opaque, in one graph. Its
    graph may keep the forward's output for backward instead of running the forward kernel again (AOTAutograd
    merges the two identical calls: 4 forward launches instead of eager's 8)."""
    result = interpreted['compiled']
    assert 'error' not in result, result.get('error')
    assert result['graphs'] == 1 and result['graph_breaks'] == 0
    assert result['eager_launches'] == {FORWARD: 8, BACKWARD_PRE: 4, BACKWARD_INPUT: 4}
    assert result['launches'] in (result['eager_launches'], {FORWARD: 4, BACKWARD_PRE: 4, BACKWARD_INPUT: 4})
    assert not result['mismatches'], '\n'.join(result['mismatches'])


@pytest.mark.parametrize(
    'call,match',
    [
        (lambda x, w, b: depthwise_conv_gelu(x, 3, 3, w, b, impl='fast'), "impl='fast'; allowed"),
        (lambda x, w, b: depthwise_conv_gelu(x, 2, 3, w, b), '9 tokens for a 2x3 map'),
        (lambda x, w, b: depthwise_conv_gelu(x, 3, 3, w[:, :, :2], b), r'weight \(4, 1, 3, 3\) and a bias'),
        (lambda x, w, b: depthwise_conv_gelu(x, 3, 3, w, None), 'got .* and None'),
    ],
    ids=['impl', 'tokens', 'kernel-size', 'no-bias'],
)
def test_malformed_calls_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.zeros(1, 9, 4), torch.zeros(4, 1, 3, 3), torch.zeros(4))


def test_cpu_tensors_are_refused_naming_the_alternative(monkeypatch):
    pytest.importorskip(MODULE)
    set_interpreted(monkeypatch, False)
    refusal = r"CUDA tensors, got cpu ones; use impl 'math' \(VVT: fused_conv_gelu=False\) there"
    with pytest.raises(RuntimeError, match=refusal):
        depthwise_conv_gelu(torch.zeros(1, 9, 4), 3, 3, torch.zeros(4, 1, 3, 3), torch.zeros(4), impl='triton')


def test_vvt_refuses_a_fused_conv_gelu_that_is_not_a_bool():
    with pytest.raises(ValueError, match="fused_conv_gelu='yes' must be True or False"):
        build_tiny(VVT, fused_conv_gelu='yes')


def test_kernels_compile_for_hopper(monkeypatch, tmp_path):
    """The launches the wrapper makes (bf16 and fp32, several token and channel tiles) compile to sm_90 machine
    code, through Triton's bundled compiler and ptxas: no GPU needed."""
    pytest.importorskip(MODULE)
    compiled = compiling_launches(monkeypatch, tmp_path)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 15 * 22, 96, dtype=dtype, requires_grad=True)
        depthwise_conv_gelu(x, 15, 22, torch.randn(96, 1, 3, 3), torch.randn(96), impl='triton').sum().backward()
    assert sorted(name for name, _ in compiled) == sorted(KERNELS * 2)
    assert all(size > 0 for _, size in compiled)


def test_kernels_do_not_spill_on_hopper(monkeypatch):
    """sm_90 machine code of every launch at VVT-S's widest hidden tensor (768 channels), bf16 and fp32, as
    ``tools/analysis/triton_resources.py`` reads it from ptxas: no register spills (with 4 warps a program the
    first backward kernel spilled 492 bytes per thread, hence 8)."""
    skip_unless_compiled()
    from visattn_mm.ops.triton import host

    triton_resources = _load_tool('analysis/triton_resources')
    reports = []

    def compile_instead(kernel, grid, settings, *args, **constexprs):
        resources = triton_resources.compiled_kernel_resources(kernel, settings, args, constexprs, 90)
        reports.append((kernel.fn.__name__, args[0].dtype, resources['spill_stores'], resources['spill_loads']))

    monkeypatch.setattr(host, 'launch', compile_instead)
    set_interpreted(monkeypatch, True)  # CPU tensors through the device check; the launches only compile
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(2, 15 * 22, 768, dtype=dtype, requires_grad=True)
        depthwise_conv_gelu(x, 15, 22, torch.randn(768, 1, 3, 3), torch.randn(768), impl='triton').sum().backward()
    assert sorted(name for name, *_ in reports) == sorted(KERNELS * 2)
    assert all(stores == loads == 0 for *_, stores, loads in reports), reports


# --------------------------------------------------------------------------
# Low precision: the kernels in fp32 / bf16 / fp16 against the math path in float64
# (tolerances: triton_harness.TOLERANCES)
# --------------------------------------------------------------------------
# (batch, H, W, channels): VVT-S's first stage at 224 (hidden 768 = 96 x 8), an odd map, its third stage.
GPU_SHAPES = [(2, 56, 56, 768), (2, 29, 37, 100), (2, 14, 14, 1280)]


def conv_gelu_errors(device, dtype, batch, height, width, channels):
    """:func:`triton_harness.low_precision_errors` of the op: ``({'output' or input: error}, kernel launches)``."""
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randn(batch, height * width, channels, generator=gen, dtype=torch.float64)]
    weights = [
        torch.randn(channels, 1, 3, 3, generator=gen, dtype=torch.float64) / 3,
        torch.randn(channels, generator=gen, dtype=torch.float64),
    ]

    def op(x, weight, bias, impl):
        return depthwise_conv_gelu(x, height, width, weight, bias, impl=impl)

    errors, launches = low_precision_errors(op, tokens, weights, device, dtype)
    return dict(zip(['output', 'x', 'weight', 'bias'], errors)), launches


def compare_fp16():
    """The 16-bit code path in the interpreter subprocess."""
    errors, launches = conv_gelu_errors('cpu', torch.float16, 2, 7, 9, 70)
    return dict(launches=launches, errors=errors)


def test_interpreted_fp16_matches_float64_math(interpreted):
    assert_fp16_within_tolerance(interpreted['fp16'], launches=3)


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', CUDA_DTYPES, ids=CUDA_DTYPE_IDS)
@pytest.mark.parametrize('shape', GPU_SHAPES, ids=str)
def test_cuda_kernels_match_float64_math(shape, dtype):
    """Within the dtype's tolerance, and the same bits on a second run (no atomics)."""
    assert_cuda_deterministic(conv_gelu_errors, dtype, 3, *shape)


if __name__ == '__main__':
    # The interpreter subprocess of the ``interpreted`` fixture: one JSON line on stdout.
    main(
        case_inputs,
        CASES,
        vvt=lambda: compare_backbone(VVT, (), (('fused_conv_gelu', True),), evaluation=True),
        fp16=compare_fp16,
        compiled=compare_compiled,
    )
