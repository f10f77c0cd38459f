"""The Triton vicinity-attention kernels (``impl='triton'``) against the math path.

As in ``test_triton_sliding_chunk.py``: the CPU comparisons run in Triton's
interpreter, in a subprocess (this file run as a script, see
:mod:`triton_harness`); every case compares, in float64, the output and the
gradients of the queries, keys and values with the math path, and counts the
launches of each kernel. Crafted inputs make each of the four signed clamps act;
the math path's own clamps are counted to prove it.
"""

import contextlib
import functools

import pytest
import torch

import visattn_mm.ops.vicinity as vicinity
from triton_harness import (
    CUDA_DTYPE_IDS,
    CUDA_DTYPES,
    TOLERANCES,
    assert_cuda_within_tolerance,
    assert_fp16_within_tolerance,
    assert_kernels_matched,
    assert_no_error,
    compare_backbone,
    compiling_launches,
    interpreted_fixture,
    low_precision_errors,
    main,
    set_interpreted,
)
from visattn_mm.models import VVT
from visattn_mm.ops.vicinity import vicinity_attention

MODULE = 'visattn_mm.ops.vicinity.triton'
KERNELS = ('_vicinity_sums', '_vicinity_forward', '_vicinity_backward_queries', '_vicinity_backward_keys')
# The math path's signed clamps, in the order it applies them.
CLAMPS = ('kv', 'z', 'numerator', 'output')
BATCH, HEADS = 2, 2
# Test-sized launches: tiles of 16 tokens and about 8 reduction programs, so a 9x13 map (117 tokens, 8 tiles)
# with 4 (batch, head) pairs runs 2 splits of 4 tiles each.
SMALL_LAYOUT = dict(MAX_BLOCK_N=16, PROGRAMS=8)
interpreted = interpreted_fixture()  # the comparisons below, run in the interpreter

# name: (H, W, head dim, clamp, inputs, launch layout). Inputs: 'plain' (q, k mostly positive, v of any sign),
# 'kv' (k x30 and a channel of v ~1e4: KV beyond 1e4), 'z' (every other query x1e3: Z below 1e-4),
# 'numerator-output' (a channel of v x1e-7 and one ~1e5: numerators beyond both bounds, outputs below 1e-4),
# 'strided' (plain, q, k, v as views of one (B, N, 3, heads, d) tensor, as the model's projections are).
# Layout None: the module's defaults.
CASES = {
    'one-token': (1, 1, 3, True, 'plain', SMALL_LAYOUT),
    'one-row': (1, 6, 16, True, 'plain', SMALL_LAYOUT),
    'odd-map-no-clamp': (3, 5, 24, False, 'plain', SMALL_LAYOUT),
    'several-splits': (9, 13, 16, True, 'plain', SMALL_LAYOUT),
    'several-splits-default-layout': (9, 13, 16, True, 'plain', None),
    'wide-heads-default-layout': (9, 13, 40, True, 'plain', None),  # head-dim tiles of 64: 16-token tiles
    'kv-clamped': (7, 4, 3, True, 'kv', SMALL_LAYOUT),
    'kv-large-no-clamp': (7, 4, 3, False, 'kv', SMALL_LAYOUT),
    'z-clamped': (3, 5, 16, True, 'z', SMALL_LAYOUT),
    'numerator-output-clamped': (9, 13, 24, True, 'numerator-output', SMALL_LAYOUT),
    'strided-views': (7, 4, 16, True, 'strided', SMALL_LAYOUT),
    'eps-zero': (3, 5, 24, False, 'plain', SMALL_LAYOUT),
}
# Cases run with eps=0: the rows of the last tile beyond the map then have a zero denominator.
EPS_ZERO = {'eps-zero'}
# The clamps each crafted input kind must make act (checked on the math path).
ACTING = {'kv': ('kv',), 'z': ('z',), 'numerator-output': ('numerator', 'output')}


@contextlib.contextmanager
def launch_layout(layout):
    """The module's tile and program settings replaced by ``layout`` inside (its defaults where None)."""
    triton_vicinity = __import__(MODULE, fromlist=['MAX_BLOCK_N'])
    previous = {name: getattr(triton_vicinity, name) for name in SMALL_LAYOUT}
    for name, value in (layout or {}).items():
        setattr(triton_vicinity, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(triton_vicinity, name, value)


def case_tensors(name, dtype, seed=0):
    """``(q, k, v)`` of a case (plain tensors; the strided case's are views of one tensor) and the tensors
    that are leaves."""
    height, width, dim, _, kind, _ = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    n = height * width
    if kind == 'strided':
        qkv = 0.5 * torch.randn(BATCH, n, 3, HEADS, dim, generator=gen, dtype=dtype) + 0.5
        qkv[:, :, 2] = torch.randn(BATCH, n, HEADS, dim, generator=gen, dtype=dtype)
        qkv.requires_grad_()
        return [qkv[:, :, i].transpose(1, 2) for i in range(3)], [qkv]
    q, k = (0.5 * torch.randn(BATCH, HEADS, n, dim, generator=gen, dtype=dtype) + 0.5 for _ in range(2))
    v = torch.randn(BATCH, HEADS, n, dim, generator=gen, dtype=dtype)
    if kind == 'kv':
        k = k * 30
        v[..., 0] = v[..., 0].abs() * 1e4
    elif kind == 'z':
        q[:, :, ::2] *= 1e3
    elif kind == 'numerator-output':
        v[..., 1] *= 1e-7
        v[..., 2] = v[..., 2].abs() * 1e5
    leaves = [t.requires_grad_() for t in (q, k, v)]
    return leaves, leaves


def case_inputs(name, dtype, device='cpu', seed=0):
    """Leaf tensors of a case and the op on them: ``(leaves, op)``, ``op(impl)`` the output."""
    height, width, _, clamp, _, layout = CASES[name]
    (q, k, v), leaves = case_tensors(name, dtype, seed)

    eps = 0.0 if name in EPS_ZERO else vicinity.EPS

    def op(impl):
        with launch_layout(layout):
            return vicinity_attention(q, k, v, height, width, eps=eps, clamp=clamp, impl=impl)

    return leaves, op


def clamps_acting(name):
    """How many entries each signed clamp of the math path changes on a case's inputs (``{clamp: count}``)."""
    height, width, *_ = CASES[name]
    (q, k, v), _ = case_tensors(name, torch.float64)
    changed = []
    clamp = vicinity.signed_clamp

    def counting(t):
        out = clamp(t)
        changed.append(int((out != t).sum()))
        return out

    vicinity.signed_clamp = counting
    try:
        with torch.no_grad():
            vicinity_attention(q, k, v, height, width, impl='math')
    finally:
        vicinity.signed_clamp = clamp
    return dict(zip(CLAMPS, changed, strict=True))


@pytest.mark.parametrize('name', CASES)
def test_interpreted_kernels_match_math(name, interpreted):
    assert_kernels_matched(interpreted[name], dict.fromkeys(KERNELS, 1))


@pytest.mark.parametrize('name', [name for name, case in CASES.items() if case[4] in ACTING])
def test_crafted_inputs_make_the_clamps_act(name):
    """The crafted cases reach the clamps they are meant to (so the comparisons above cover them), and
    without the clamps the math path's output changes."""
    height, width, _, clamp, kind, _ = CASES[name]
    acting = clamps_acting(name)
    assert all(acting[clamp_name] > 0 for clamp_name in ACTING[kind]), acting
    (q, k, v), _ = case_tensors(name, torch.float64)
    with torch.no_grad():
        assert not torch.allclose(
            vicinity_attention(q, k, v, height, width, clamp=True, impl='math'),
            vicinity_attention(q, k, v, height, width, clamp=False, impl='math'),
        )


def test_backbone_attn_impl_triton_runs_the_kernels(interpreted):
    """VVT(attn_impl='triton'): every vicinity attention runs the kernels (one block per stage) and outputs and
    parameter gradients equal the math path's."""
    assert_kernels_matched(interpreted['backbone'], dict.fromkeys(KERNELS, 4))


def test_reductions_are_split_over_the_tokens():
    """The test layout gives the 9x13 cases (8 tiles) several splits of several tiles. The default one spreads
    VVT-S's first stage at 800x1333 (batch 8, 1 head of dim 48: 200x334 tokens) over 512 programs of 66 tiles of
    16 tokens, with 16 warps (head-dim tiles of 64: see WIDE_BLOCK_D), and its last stage (8 heads of dim 32)
    over 7 splits of 5 tiles of 32 tokens per pair, with 8 warps."""
    tv = pytest.importorskip(MODULE)
    with launch_layout(SMALL_LAYOUT):
        assert tv._layout(BATCH * HEADS, 9 * 13, tv.MAX_BLOCK_N) == (16, 2, 4)  # (tile side, splits, tiles per split)

    def launch(batch, heads, height, width, head_dim):
        q = torch.empty(1, 1, 1, 1).expand(batch, heads, height * width, head_dim)
        _, grid, settings, shape, tile = tv._launch_setup(q, height, width, 1e-6, True, False)
        return tile.BLOCK_N, grid, settings['num_warps'], shape[-1]

    assert launch(8, 1, 200, 334, 48) == (16, (64, 8), 16, 66)
    assert launch(8, 8, 25, 42, 32) == (32, (7, 64), 8, 5)


@pytest.mark.parametrize(
    'shapes,match',
    [
        (((1, 2, 9, 4), (1, 2, 9, 4), (1, 2, 9, 4)), '9 tokens, not height'),
        (((1, 2, 9, 4), (1, 2, 9, 5), (1, 2, 9, 4)), 'q, k and v must be .* of one shape'),
        (((1, 2, 9, 4), (1, 2, 9, 4), (1, 1, 9, 4)), 'q, k and v must be .* of one shape'),
        (((2, 9, 4), (2, 9, 4), (2, 9, 4)), 'q, k and v must be .* of one shape'),
    ],
    ids=['tokens', 'head-dim', 'heads', 'three-dims'],
)
def test_malformed_calls_are_refused(shapes, match):
    attention = pytest.importorskip(MODULE).triton_vicinity_attention
    q, k, v = (torch.zeros(shape) for shape in shapes)
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, 2, 3)


@pytest.mark.parametrize(
    'dtype,head_dim,interpreted,limit',
    [(torch.float32, 65, True, '64'), (torch.float16, 96, False, '64'), (torch.float64, 33, False, '32 in float64')],
)
def test_head_dims_beyond_shared_memory_are_refused(monkeypatch, dtype, head_dim, interpreted, limit):
    """Head dims whose (4d x d) sums exceed a GPU's shared memory (float64 on the GPU from 33) are refused,
    naming the alternative; the interpreter runs float64 at any head dim up to 64 (the tests' reference)."""
    attention = pytest.importorskip(MODULE).triton_vicinity_attention
    set_interpreted(monkeypatch, interpreted)
    q = torch.zeros(1, 1, 6, head_dim, dtype=dtype)
    with pytest.raises(ValueError, match=f"head dims up to {limit}, got {head_dim}.*impl 'math'"):
        attention(q, q, q, 2, 3)


def test_cpu_tensors_are_refused_naming_the_alternative(monkeypatch):
    attention = pytest.importorskip(MODULE).triton_vicinity_attention
    set_interpreted(monkeypatch, False)
    q = torch.zeros(1, 2, 9, 4)
    with pytest.raises(RuntimeError, match="CUDA tensors.*'fast' or 'math'"):
        attention(q, q, q, 3, 3)


def test_kernels_compile_for_hopper(monkeypatch, tmp_path):
    """The launches the wrapper makes (bf16, with and without bf16 products, fp32 and fp64; VVT's head dims 48
    (16 warps) and 32, and an odd one) compile to sm_90 machine code, through Triton's bundled compiler and
    ptxas: no GPU needed."""
    tv = pytest.importorskip(MODULE)
    compiled = compiling_launches(monkeypatch, tmp_path)
    cases = (
        (torch.bfloat16, 48, False),
        (torch.bfloat16, 48, True),
        (torch.float32, 32, False),
        (torch.float64, 24, False),
    )
    for dtype, dim, bf16_products in cases:
        height, width = 15, 22
        q, k, v = (torch.randn(1, 4, height * width, dim, dtype=dtype, requires_grad=True) for _ in range(3))
        tv.triton_vicinity_attention(q, k, v, height, width, bf16_products=bf16_products).sum().backward()
    assert sorted(name for name, _ in compiled) == sorted(KERNELS * 4)
    assert all(size > 0 for _, size in compiled)


# --------------------------------------------------------------------------
# Low precision: the kernels in fp32 / bf16 / fp16 against the math path in float64
# (tolerances: triton_harness.TOLERANCES)
# --------------------------------------------------------------------------
# (H, W): VVT's first stage at 224; an odd map; a long one (several splits of several tiles per pair).
GPU_SHAPES = [(56, 56), (29, 37), (100, 167)]


def vicinity_errors(device, dtype, height, width, batch=2, heads=4, dim=32, bf16_products=False):
    """:func:`triton_harness.low_precision_errors` of vicinity attention: ``({'output' or input: error},
    kernel launches)``; ``bf16_products`` for the Triton run (the float64 reference has none)."""
    gen = torch.Generator().manual_seed(0)
    tokens = [
        0.5 * torch.randn(batch, heads, height * width, dim, generator=gen, dtype=torch.float64) + 0.5 for _ in range(2)
    ]
    tokens.append(torch.randn(batch, heads, height * width, dim, generator=gen, dtype=torch.float64))

    def op(q, k, v, impl):
        return vicinity_attention(q, k, v, height, width, impl=impl, bf16_products=bf16_products)

    errors, launches = low_precision_errors(op, tokens, [], device, dtype)
    return dict(zip(['output', 'q', 'k', 'v'], errors)), launches


def compare_low_precision(dtype, bf16_products=False):
    """The 16-bit inputs in the interpreter subprocess: loaded, converted to fp32 and computed there."""
    with launch_layout(SMALL_LAYOUT):
        errors, launches = vicinity_errors('cpu', dtype, 9, 13, batch=1, heads=2, dim=16, bf16_products=bf16_products)
    return dict(launches=launches, errors=errors)


def test_interpreted_fp16_matches_float64_math(interpreted):
    assert_fp16_within_tolerance(interpreted['fp16'], launches=4)


def test_interpreted_bf16_matches_float64_math(interpreted):
    result = interpreted['bf16']
    assert_no_error(result)
    assert result['launches'] == 4
    assert max(result['errors'].values()) < TOLERANCES[torch.bfloat16], result['errors']


def test_interpreted_bf16_products_stay_within_the_bf16_tolerance(interpreted):
    """``bf16_products=True``: the six products of bf16-rounded operands (in the interpreter, which cannot
    multiply bf16 tiles, multiplied in fp32). They cost precision, most in the gradient of ``q`` (a small
    difference of two products), and stay within bf16's tolerance, as the torch path's option does
    (tests/test_ops/test_vicinity.py)."""
    plain, products = interpreted['bf16'], interpreted['bf16_products']
    assert_no_error(products)
    assert products['launches'] == 4
    assert max(products['errors'].values()) < TOLERANCES[torch.bfloat16], products['errors']
    assert products['errors']['q'] > 2 * plain['errors']['q'], (plain['errors'], products['errors'])


@pytest.mark.cuda
@pytest.mark.parametrize('shape', GPU_SHAPES, ids=str)
def test_cuda_bf16_products_match_float64_math(shape):
    """On tensor cores: the bf16 products within bf16's tolerance of float64."""
    assert_cuda_within_tolerance(functools.partial(vicinity_errors, bf16_products=True), torch.bfloat16, 4, *shape)


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', CUDA_DTYPES, ids=CUDA_DTYPE_IDS)
@pytest.mark.parametrize('shape', GPU_SHAPES, ids=str)
def test_cuda_kernels_match_float64_math(shape, dtype):
    assert_cuda_within_tolerance(vicinity_errors, dtype, 4, *shape)


if __name__ == '__main__':
    # The interpreter subprocess of the ``interpreted`` fixture: one JSON line on stdout.
    main(
        case_inputs,
        CASES,
        backbone=lambda: compare_backbone(VVT),
        fp16=lambda: compare_low_precision(torch.float16),
        bf16=lambda: compare_low_precision(torch.bfloat16),
        bf16_products=lambda: compare_low_precision(torch.bfloat16, bf16_products=True),
    )
