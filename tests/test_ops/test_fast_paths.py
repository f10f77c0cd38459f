"""Fused (fast) attention paths against the explicit (math) paths, and the selection API.

Each op runs once per path on the same leaf inputs; outputs and the gradients of
every input must agree. A spy on ``scaled_dot_product_attention`` proves that the
two runs really took different paths.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

import visattn_mm.ops.impl as impl_module
from visattn_mm.ops import ATTENTION_IMPLS, attention_impl, get_attention_impl, set_attention_impl
from visattn_mm.ops.indexing import segment_pad
from visattn_mm.ops.long_short import long_short_attention
from visattn_mm.ops.pale import pale_attention
from visattn_mm.ops.sliding_chunk import sliding_chunk_attention
from visattn_mm.ops.specs import LONG_SHORT, SLIDING_CHUNK

HEADS, DIM = 2, 5
TOLERANCES = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-5)}


def random_tensors(shapes, dtype, seed=0):
    """Leaf tensors of the given shapes (None for a None shape), requiring grad."""
    g = torch.Generator().manual_seed(seed)
    return [None if s is None else torch.randn(*s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def count_fused_calls(monkeypatch):
    """Spy on the fused kernel: returns the list that grows by one per call."""
    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, 'scaled_dot_product_attention', spy)
    return calls


def run_path(impl, op, inputs, monkeypatch):
    """Output and input gradients of ``op(*inputs)`` on one path; counts fused-kernel calls."""
    sdpa = F.scaled_dot_product_attention
    calls = count_fused_calls(monkeypatch)
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    with attention_impl(impl):
        out = op(*inputs)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), leaves)
    monkeypatch.setattr(F, 'scaled_dot_product_attention', sdpa)
    return out, grads, len(calls)


def assert_paths_agree(op, inputs, monkeypatch, **tolerance):
    math_out, math_grads, math_calls = run_path('math', op, inputs, monkeypatch)
    fast_out, fast_grads, fast_calls = run_path('fast', op, inputs, monkeypatch)
    assert math_calls == 0 and fast_calls > 0, (math_calls, fast_calls)
    tolerance = tolerance or TOLERANCES[math_out.dtype]
    torch.testing.assert_close(fast_out, math_out, **tolerance)
    for fast, math in zip(fast_grads, math_grads):
        torch.testing.assert_close(fast, math, **tolerance)


# --- sliding chunk: (H, W, w) odd, non-square, padded, < 3 chunks, smaller than a chunk.
SLIDING_CASES = [
    # H, W, w, masking, shift, globals, rpb
    (7, 9, 3, 0, 0, 1, True),
    (5, 11, 2, 0, 0, 0, True),
    (2, 5, 3, 0, 0, 2, True),
    (10, 11, 3, -1, 0, 2, True),
    (10, 10, 3, -1, -1, 0, False),
    (7, 9, 3, 1, 0, 1, True),
    (8, 7, 4, 1, 0, 0, False),
    (9, 10, 3, 0, 3, 1, True),
    (9, 10, 3, 0, 8, 0, True),
    (9, 10, 3, 0, -1, 2, False),
]


def sliding_chunk_inputs(height, width, window, num_global, rpb, dtype):
    n, w2 = height * width, window**2
    g = num_global or None
    return random_tensors(
        [(2, HEADS, n, DIM)] * 3
        + [g and (2, HEADS, g, DIM)] * 2
        + [rpb and (HEADS, w2, 9 * w2) or None, g and (HEADS, g)],
        dtype,
    )


@pytest.mark.parametrize('height,width,window,masking_mode,shift_mode,num_global,rpb', SLIDING_CASES)
def test_sliding_chunk_fast_path_matches_math(
    height, width, window, masking_mode, shift_mode, num_global, rpb, monkeypatch
):
    def op(q, k, v, gk, gv, local_bias, l2g_bias):
        return sliding_chunk_attention(
            q,
            k,
            v,
            height,
            width,
            window,
            global_k=gk,
            global_v=gv,
            local_bias=local_bias,
            l2g_bias=l2g_bias,
            masking_mode=masking_mode,
            shift_mode=shift_mode,
        )

    inputs = sliding_chunk_inputs(height, width, window, num_global, rpb, torch.float64)
    assert_paths_agree(op, inputs, monkeypatch)


# --- long-short: with / without dynamic projection, global tokens, RPB.
LONG_SHORT_CASES = [
    # H, W, w, projected r, globals, rpb
    (7, 9, 3, 2, 1, True),
    (5, 11, 2, 0, 0, True),
    (3, 5, 4, 1, 1, True),
    (8, 8, 4, 3, 0, False),
    (9, 7, 3, 0, 2, False),
]


@pytest.mark.parametrize('height,width,window,num_bar,num_global,rpb', LONG_SHORT_CASES)
def test_long_short_fast_path_matches_math(height, width, window, num_bar, num_global, rpb, monkeypatch):
    def op(q, k, v, k_bar, v_bar, gk, gv, local_bias):
        return long_short_attention(
            q, k, v, height, width, window, k_bar=k_bar, v_bar=v_bar, global_k=gk, global_v=gv, local_bias=local_bias
        )

    n, r, g = height * width, num_bar or None, num_global or None
    patch = (window + 2 * segment_pad(window)) ** 2
    inputs = random_tensors(
        [(2, HEADS, n, DIM)] * 3
        + [r and (2, HEADS, r, DIM)] * 2
        + [g and (2, HEADS, g, DIM)] * 2
        + [rpb and (HEADS, window**2, patch) or None],
        torch.float64,
    )
    assert_paths_agree(op, inputs, monkeypatch)


# --- pale: padded and unpadded axes, maps smaller than the pale, asymmetric pale sizes.
@pytest.mark.parametrize('height,width,pale_size', [(7, 9, 3), (14, 21, 7), (5, 11, (2, 4)), (2, 3, 7)])
def test_pale_fast_path_matches_math(height, width, pale_size, monkeypatch):
    inputs = random_tensors([(2, 2 * HEADS, height * width, DIM)] * 3, torch.float64)
    assert_paths_agree(lambda q, k, v: pale_attention(q, k, v, height, width, pale_size), inputs, monkeypatch)


def test_fast_paths_match_math_in_float32(monkeypatch):
    """The fused CPU kernel itself (float64 runs PyTorch's math kernel) against the explicit path."""
    inputs = sliding_chunk_inputs(9, 10, 3, 1, True, torch.float32)
    for t in inputs[5:]:
        t.requires_grad_(False)  # a bias without grad lets PyTorch use the fused kernel
    assert_paths_agree(
        lambda *t: sliding_chunk_attention(
            *t[:3], 9, 10, 3, global_k=t[3], global_v=t[4], local_bias=t[5], l2g_bias=t[6]
        ),
        inputs,
        monkeypatch,
    )
    inputs = random_tensors([(1, 2, 14 * 9, 8)] * 3, torch.float32)
    assert_paths_agree(lambda q, k, v: pale_attention(q, k, v, 14, 9, 7), inputs, monkeypatch)


def test_bf16_paths_agree_within_bf16_precision(monkeypatch):
    """Both paths softmax in fp32 (explicitly / inside the fused kernel); only bf16 rounding of
    the logits and of the probabilities before ``@ v`` differs."""
    inputs = random_tensors([(1, 2, 14 * 9, 8)] * 3, torch.bfloat16)
    assert_paths_agree(lambda q, k, v: pale_attention(q, k, v, 14, 9, 7), inputs, monkeypatch, rtol=0.05, atol=0.05)


def test_dropout_runs_on_the_fast_path():
    q, k, v = random_tensors([(1, 2, 7 * 9, DIM)] * 3, torch.float32)
    with attention_impl('fast'):
        plain = pale_attention(q, k, v, 7, 9, 3)
        torch.manual_seed(0)
        dropped = pale_attention(q, k, v, 7, 9, 3, dropout_p=0.5)
    assert torch.isfinite(dropped).all() and not torch.allclose(plain, dropped)


def saved_bytes(op):
    """Bytes of the tensors autograd saves for backward while running ``op()``."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        op()
    return sum(total)


def test_pale_fast_path_saves_linear_memory():
    """4x tokens: the fast path saves at most ~4.5x; the math path's (s*W)^2 scores grow ~8x."""

    def pale(impl, side):
        q, k, v = random_tensors([(1, 2, side * side, 8)] * 3, torch.float32)
        with attention_impl(impl):
            return saved_bytes(lambda: pale_attention(q, k, v, side, side, 7))

    fast_ratio = pale('fast', 56) / pale('fast', 28)
    math_ratio = pale('math', 56) / pale('math', 28)
    assert fast_ratio <= 4.5 < 7 < math_ratio, (fast_ratio, math_ratio)


def test_impl_selection_api(monkeypatch):
    initial = get_attention_impl()
    assert ATTENTION_IMPLS == ('auto', 'fast', 'math', 'triton') and initial in ATTENTION_IMPLS
    with pytest.raises(ValueError, match=r"'auto', 'fast', 'math'"):
        set_attention_impl('flash')
    with pytest.raises(RuntimeError), attention_impl('math'):
        assert get_attention_impl() == 'math'
        raise RuntimeError
    assert get_attention_impl() == initial
    cpu, trained_bias, frozen_bias = torch.zeros(1), torch.zeros(1, requires_grad=True), torch.zeros(1)
    path = impl_module.attention_path  # of a part of an op (None: no Triton kernels of its own)
    with attention_impl('math'):
        assert path(None, cpu) == 'math'
    with attention_impl('fast'):
        assert path(None, cpu, trained_bias) == 'fast'
    with attention_impl('auto'):
        # The CPU kernel cannot return bias gradients: 'auto' keeps the explicit path then.
        assert path(None, cpu, None, frozen_bias) == 'fast'
        assert path(None, cpu, None, trained_bias) == 'math'
        with torch.no_grad():
            assert path(None, cpu, trained_bias) == 'fast'
    try:
        monkeypatch.setenv(impl_module.ENV_VAR, 'fast')
        assert importlib.reload(impl_module).get_attention_impl() == 'fast'
        monkeypatch.setenv(impl_module.ENV_VAR, 'dense')
        with pytest.raises(ValueError, match='dense'):
            importlib.reload(impl_module)
    finally:
        monkeypatch.undo()
        importlib.reload(impl_module)
    assert get_attention_impl() == initial


def test_process_state_is_one_object_that_resets():
    """The selection, the device override, the launch counts, the caches and the warnings given live
    in visattn_mm.ops.process_state.STATE; reset() returns them to how import left them."""
    from visattn_mm.ops.common import device_cache
    from visattn_mm.ops.process_state import STATE

    cached = device_cache(lambda size: torch.zeros(size))
    saved = (STATE.attention_impl, dict(STATE.kernel_launches), set(STATE.warnings_given))
    try:
        set_attention_impl('math' if STATE.default_attention_impl != 'math' else 'fast')
        STATE.kernel_launches['a_kernel'] += 1
        with pytest.warns(UserWarning, match='said once'):
            STATE.warn_once('a_warning', 'said once')
            STATE.warn_once('a_warning', 'said once')  # not again
        cached(3)
        with impl_module.dispatch_as('cuda'):
            assert impl_module.dispatch_device_type('cpu') == 'cuda'
            STATE.reset()
            assert impl_module.dispatch_device_type('cpu') == 'cpu'
        assert get_attention_impl() == STATE.default_attention_impl
        assert not STATE.kernel_launches and not STATE.warnings_given
        assert cached.cache_info().currsize == 0
    finally:
        STATE.attention_impl, STATE.warnings_given = saved[0], saved[2]
        STATE.kernel_launches.update(saved[1])


@pytest.mark.parametrize('backbone', ['ViL', 'ViLLS', 'PaleTransformer'])
def test_backbone_attn_impl_argument_chooses_the_path(backbone, monkeypatch):
    """The constructor argument picks the path of every attention op (spy on the fused
    kernel) whatever the process-wide selection (which steers only 'auto'), both give the same
    output, and a wrong value is refused with the allowed ones."""
    import visattn_mm.models as models

    calls = count_fused_calls(monkeypatch)
    cls = getattr(models, backbone)
    images = torch.randn(1, 3, 45, 61, dtype=torch.float64)
    outputs = {}
    for attn_impl in ('math', 'fast'):
        torch.manual_seed(0)
        model = cls(arch='tiny', attn_impl=attn_impl).double().eval()
        calls.clear()
        with torch.no_grad():
            outputs[attn_impl] = model(images)
        assert bool(calls) == (attn_impl == 'fast'), (attn_impl, len(calls))
        calls.clear()
        with attention_impl('fast' if attn_impl == 'math' else 'math'), torch.no_grad():
            model(images)
        assert bool(calls) == (attn_impl == 'fast')  # the explicit value won
    calls.clear()
    auto = cls(arch='tiny', attn_impl='auto').double().eval()
    with attention_impl('math'), torch.no_grad():
        auto(images)
    assert not calls  # 'auto' follows the process-wide selection
    for fast, math in zip(outputs['fast'], outputs['math']):
        torch.testing.assert_close(fast, math, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match=r"attn_impl='flash'.*'auto', 'fast', 'math'"):
        cls(arch='tiny', attn_impl='flash')


def test_vvt_bf16_products_sets_the_precision_of_its_products(monkeypatch):
    """VVT's bf16_products reaches every vicinity attention: under bf16 autocast True runs their
    matrix products on bf16 operands, False in fp32 whatever the attn_impl (forward and the
    recomputing backward); the outputs agree to bf16 precision."""
    import visattn_mm.ops.vicinity as vicinity
    from visattn_mm.models import VVT
    from visattn_mm.models.vvt import VicinityAttention

    operands = []
    # The products of every path but Triton's: forward (and its recomputation under checkpoint),
    # and the fp32 path's hand-written backward.
    for name in ('_vicinity_parts', '_vicinity_grads'):

        def spy(*args, run=getattr(vicinity, name), **kwargs):
            operands.append(args[-1])
            return run(*args, **kwargs)

        monkeypatch.setattr(vicinity, name, spy)
    images = torch.randn(1, 3, 45, 61)
    outputs = {}
    for attn_impl, bf16_products in [(impl, False) for impl in ATTENTION_IMPLS] + [('auto', True)]:
        torch.manual_seed(0)
        model = VVT(arch='tiny', attn_impl=attn_impl, bf16_products=bf16_products, drop_path_rate=0.0)
        operands.clear()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            outputs[attn_impl, bf16_products] = out = model(images)
        sum(o.float().sum() for o in out).backward()
        blocks = sum(isinstance(m, VicinityAttention) for m in model.modules())
        assert set(operands) == {torch.bfloat16 if bf16_products else torch.float32}, (attn_impl, operands)
        assert len(operands) == 2 * blocks  # forward, and backward's recomputation
    for bf16, fp32 in zip(outputs['auto', True], outputs['auto', False]):
        torch.testing.assert_close(bf16.float(), fp32.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize('backbone', ['ViL', 'ViLLS', 'PaleTransformer', 'VVT'])
def test_backbone_logs_its_attention_implementation_once_at_build(backbone, monkeypatch):
    import visattn_mm.models as models
    import visattn_mm.models.layers as layers

    lines = []
    monkeypatch.setattr(layers, 'print_log', lambda msg, logger=None: lines.append(msg))
    getattr(models, backbone)(arch='tiny', attn_impl='math')
    # Of the attention the backbone has: ViL's line says nothing of vicinity attention, VVT's nothing of softmax.
    math = 'vicinity attention in torch ops' if backbone == 'VVT' else 'the explicit softmax (the reference)'
    assert lines == [f"{backbone}: attn_impl='math': {math}"]
    lines.clear()
    with attention_impl('fast'):
        getattr(models, backbone)(arch='tiny', attn_impl='math')  # explicit: kept, said as such
        getattr(models, backbone)(arch='tiny', attn_impl='auto')
    assert len(lines) == 2 and 'process-wide' not in lines[0], lines
    assert "selected process-wide: 'fast'" in lines[1], lines


@pytest.mark.parametrize('op_name', [SLIDING_CHUNK.name, LONG_SHORT.name])
def test_fused_paths_gather_keys_again_in_backward(op_name, monkeypatch):
    """The fused ViL and ViL-LS paths keep the tokens, not their gathered neighbour keys and values,
    for the attention's backward (``RegatherInBackward``): the rows are gathered again there, the
    outputs and every gradient are those of keeping them, bit for bit, the step's peak memory is
    lower, and a token tensor changed in place in between is refused. The bias needs no gradient
    here: with one, PyTorch's CPU SDPA takes its math path, which keeps copies of the keys (CUDA's
    memory-efficient kernel keeps them as given, as the traced step shows)."""
    import contextlib

    import visattn_mm.ops.chunk_gather as chunk_gather
    from visattn_mm.analysis.step_cost import trace_step

    height, width, window = 9, 10, 3

    def op(q, k, v, bias):
        if op_name == 'sliding_chunk':
            return sliding_chunk_attention(q, k, v, height, width, window, local_bias=bias, impl='fast')
        return long_short_attention(q, k, v, height, width, window, local_bias=bias, impl='fast')

    patch = 9 * window**2 if op_name == 'sliding_chunk' else (window + 2 * segment_pad(window)) ** 2
    shapes = [(2, HEADS, height * width, DIM)] * 3 + [(HEADS, window**2, patch)]
    gathers = []
    gathered = chunk_gather._gathered
    monkeypatch.setattr(chunk_gather, '_gathered', lambda *a: gathers.append(len(a)) or gathered(*a))
    results = {}
    for regather in (True, False):
        if not regather:
            monkeypatch.setattr(chunk_gather, 'regathered_in_backward', lambda *a: contextlib.nullcontext())
        inputs = random_tensors(shapes, torch.float64)
        inputs[3].requires_grad_(False)
        gathers.clear()
        out = op(*inputs)
        forward_gathers = len(gathers)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
        grads = torch.autograd.grad((out * weights).sum(), inputs[:3])
        results[regather] = (out, grads, forward_gathers, len(gathers) - forward_gathers)
    assert results[True][2:] == (2, 1) and results[False][2:] == (2, 0)  # queries, keys + values; again
    for a, b in zip((results[True][0], *results[True][1]), (results[False][0], *results[False][1])):
        assert torch.equal(a, b)

    class Blocks(torch.nn.Module):  # what one op keeps adds up over blocks until backward
        def __init__(self):
            super().__init__()
            self.inputs = torch.nn.ParameterList(random_tensors(shapes, torch.float32))

        def forward(self, images):
            q, k, v, bias = self.inputs
            for _ in range(4):
                q = op(q, k, v, bias)
            return q

    peaks = {}
    for regather in (False, True):
        if regather:
            monkeypatch.undo()
        peaks[regather] = trace_step(Blocks(), (1,), dtype='fp32').peak_bytes
    assert peaks[True] < peaks[False], peaks

    inputs = random_tensors(shapes, torch.float64)
    inputs[3].requires_grad_(False)
    k = inputs[1] * 1.0  # a non-leaf token tensor, changed in place after the forward pass
    out = op(inputs[0], k, inputs[2], inputs[3])
    with torch.no_grad():
        k.add_(1)
    with pytest.raises(RuntimeError, match='modified in place'):
        out.sum().backward()
