"""The Triton pale-attention kernels (``impl='triton'``) against the math path.

As in ``test_triton_sliding_chunk.py``: the CPU comparisons run in Triton's
interpreter, in a subprocess (this file run as a script, see
:mod:`triton_harness`); every case compares, in float64, the output and the
gradients of the queries, keys and values with the math path, and counts the
launches of each kernel (one per branch: row and column).
"""

import contextlib

import pytest
import torch

from triton_harness import (
    CUDA_DTYPE_IDS,
    CUDA_DTYPES,
    assert_cuda_within_tolerance,
    assert_fp16_within_tolerance,
    assert_kernels_matched,
    compare_backbone,
    compiling_launches,
    interpreted_fixture,
    low_precision_errors,
    main,
    set_interpreted,
)
from visattn_mm.models import PaleTransformer
from visattn_mm.ops.pale import pale_attention

MODULE = 'visattn_mm.ops.pale.triton'
KERNELS = ('_pale_forward', '_pale_backward_queries', '_pale_backward_keys')
BATCH = 2
interpreted = interpreted_fixture()  # the comparisons below, run in the interpreter

# name: (H, W, pale size, heads, head dim, largest tile side or None for the default)
# A tile side of 16 splits groups of more than 16 tokens into several query and key tiles. 'strided'
# cases take q, k, v as views of one (B, N, 3, heads, d) tensor.
CASES = {
    'odd-non-square': (5, 7, 2, 2, 4, None),
    'pair-several-tiles': (7, 9, (2, 3), 4, 5, 16),
    'smaller-than-the-pale': (3, 2, 4, 2, 8, None),
    'pale-1': (4, 5, 1, 2, 6, 16),
    'pale-4-square': (8, 8, 4, 2, 4, 16),
    'pair-3-4-padded': (7, 6, (3, 4), 4, 16, 16),
    'strided-views': (5, 6, (1, 2), 2, 4, 16),
}
STRIDED = {'strided-views'}


@contextlib.contextmanager
def largest_tile(block):
    """Tiles of at most ``block`` slots inside (the module's default where None)."""
    if block is None:
        yield
        return
    triton_pale = __import__(MODULE, fromlist=['MAX_BLOCK'])
    previous, triton_pale.MAX_BLOCK = triton_pale.MAX_BLOCK, block
    try:
        yield
    finally:
        triton_pale.MAX_BLOCK = previous


def case_inputs(name, dtype, device='cpu', seed=0):
    """Leaf tensors of a case and the op on them: ``(leaves, op)``, ``op(impl)`` the output."""
    height, width, pale_size, heads, dim, block = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    n = height * width

    def leaf(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(device).requires_grad_()

    if name in STRIDED:
        qkv = leaf(BATCH, n, 3, heads, dim)
        leaves = [qkv]
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    else:
        leaves = q, k, v = [leaf(BATCH, heads, n, dim) for _ in range(3)]

    def op(impl):
        with largest_tile(block):
            return pale_attention(q, k, v, height, width, pale_size, impl=impl)

    return list(leaves), op


@pytest.mark.parametrize('name', CASES)
def test_interpreted_kernels_match_math(name, interpreted):
    assert_kernels_matched(interpreted[name], dict.fromkeys(KERNELS, 2))


def test_backbone_attn_impl_triton_runs_the_kernels(interpreted):
    """PaleTransformer(attn_impl='triton'): every pale attention runs the kernels (forward and backward
    once per branch and stage) and outputs and parameter gradients equal the math path's."""
    assert_kernels_matched(interpreted['backbone'], dict.fromkeys(KERNELS, 8))


def _odd_heads(attention, q):
    return attention(*(torch.zeros(1, 3, 9, 4) for _ in range(3)), 3, 3, 2)


@pytest.mark.parametrize(
    'call,match',
    [
        (lambda attention, q: attention(q, q, q, 3, 3, 2, dropout_p=0.1), "dropout.*'fast' or 'math'"),
        (lambda attention, q: attention(q, q, q, 2, 3, 2), '9 tokens, not height'),
        (_odd_heads, '3 heads cannot be split'),
        (lambda attention, q: attention(q, q, q, 3, 3, (2, 0)), 'pale_size must be a positive int'),
    ],
    ids=['dropout', 'tokens', 'odd-heads', 'pale-size'],
)
def test_malformed_calls_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call(pytest.importorskip(MODULE).triton_pale_attention, torch.zeros(1, 2, 9, 4))


def test_cpu_tensors_are_refused_naming_the_alternative(monkeypatch):
    attention = pytest.importorskip(MODULE).triton_pale_attention
    set_interpreted(monkeypatch, False)
    q = torch.zeros(1, 2, 9, 4)
    with pytest.raises(RuntimeError, match="CUDA tensors.*'fast' or 'math'"):
        attention(q, q, q, 3, 3, 2)


def test_kernels_compile_for_hopper(monkeypatch, tmp_path):
    """The launches the wrapper makes (bf16 and fp32, groups of several tiles, a padded row axis)
    compile to sm_90 machine code, through Triton's bundled compiler and ptxas: no GPU needed."""
    tp = pytest.importorskip(MODULE)
    compiled = compiling_launches(monkeypatch, tmp_path)
    for dtype in (torch.bfloat16, torch.float32):
        height, width, dim = 15, 22, 32
        q, k, v = (torch.randn(1, 4, height * width, dim, dtype=dtype, requires_grad=True) for _ in range(3))
        tp.triton_pale_attention(q, k, v, height, width, (7, 3)).sum().backward()
    assert sorted(name for name, _ in compiled) == sorted(KERNELS * 4)
    assert all(size > 0 for _, size in compiled)


# --------------------------------------------------------------------------
# Low precision: the kernels in fp32 / bf16 / fp16 against the math path in float64
# (tolerances: triton_harness.TOLERANCES)
# --------------------------------------------------------------------------
# (H, W, pale size): Pale-T's stage 1 at 224 (groups of 392 tokens); an odd map with a pair; stage 3.
GPU_SHAPES = [(56, 56, 7), (29, 37, (7, 5)), (14, 14, 7)]


def pale_errors(device, dtype, height, width, pale_size, batch=2, heads=4, dim=32):
    """:func:`triton_harness.low_precision_errors` of pale attention: ``({'output' or input: error},
    kernel launches)``."""
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randn(batch, heads, height * width, dim, generator=gen, dtype=torch.float64) for _ in range(3)]

    def op(q, k, v, impl):
        return pale_attention(q, k, v, height, width, pale_size, impl=impl)

    errors, launches = low_precision_errors(op, tokens, [], device, dtype)
    return dict(zip(['output', 'q', 'k', 'v'], errors)), launches


def compare_fp16():
    """The 16-bit code path in the interpreter subprocess: fp16 (its tl.dot mishandles bf16)."""
    with largest_tile(16):
        errors, launches = pale_errors('cpu', torch.float16, 7, 9, (2, 3), batch=1, heads=2, dim=8)
    return dict(launches=launches, errors=errors)


def test_interpreted_fp16_matches_float64_math(interpreted):
    assert_fp16_within_tolerance(interpreted['fp16'], launches=6)


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', CUDA_DTYPES, ids=CUDA_DTYPE_IDS)
@pytest.mark.parametrize('shape', GPU_SHAPES, ids=str)
def test_cuda_kernels_match_float64_math(shape, dtype):
    assert_cuda_within_tolerance(pale_errors, dtype, 6, *shape)


if __name__ == '__main__':
    # The interpreter subprocess of the ``interpreted`` fixture: one JSON line on stdout.
    main(case_inputs, CASES, backbone=lambda: compare_backbone(PaleTransformer), fp16=compare_fp16)
