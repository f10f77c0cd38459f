"""The Triton long-short kernels (``impl='triton'``) against the math path.

As in ``test_triton_sliding_chunk.py``: the CPU comparisons run in Triton's
interpreter, in a subprocess (this file run as a script, see
:mod:`triton_harness`); every case compares, in float64, the output and the
gradients of every input (queries, local / projected / global keys and values,
window RPB) with the math path, and counts the launches of each kernel.
"""

import pytest
import torch

from triton_harness import (
    CUDA_DTYPE_IDS,
    CUDA_DTYPES,
    assert_cuda_deterministic,
    assert_cuda_within_tolerance,
    assert_fp16_within_tolerance,
    assert_kernels_matched,
    assert_no_error,
    compare_backbone,
    compare_deterministic,
    compiling_launches,
    deterministic_algorithms,
    interpreted_fixture,
    low_precision_errors,
    main,
)
from visattn_mm.models import ViLLS
from visattn_mm.ops.indexing import segment_pad
from visattn_mm.ops.long_short import long_short_attention
from visattn_mm.ops.rel_pos import long_short_rpb_index, long_short_rpb_table_size

MODULE = 'visattn_mm.ops.long_short.triton'
KERNELS = ('_long_short_forward', '_long_short_backward_queries', '_long_short_backward_keys')
BIAS_GRAD_KERNEL = '_long_short_bias_grad'
# The cases run again under deterministic algorithms: a patch of 2 tiles with its bias a leaf, of 4 tiles
# gathered from a table.
DETERMINISTIC_CASES = ('odd-non-square', 'window-4-segment-fills-the-tile')
SLIDING_CHUNK_KERNELS = ('_sliding_chunk_forward', '_sliding_chunk_backward_queries', '_sliding_chunk_backward_keys')
BATCH, HEADS = 2, 2
interpreted = interpreted_fixture()  # the comparisons below, run in the interpreter

# name: (H, W, w, projected keys r, global tokens G, head dim, window RPB)
# RPB: 'grad' (a leaf), 'frozen' (no gradient), 'table' (gathered from an RPB table, like the backbone),
# None. 'strided' cases take q, k, v and the global tokens as views of one qkv tensor, and the
# projected keys and values as (B, r, heads, d) storage, as the backbone does.
CASES = {
    'odd-non-square': (5, 7, 3, 2, 1, 4, 'grad'),
    'window-2-no-projection': (5, 3, 2, 0, 1, 6, 'grad'),
    'window-4-segment-fills-the-tile': (9, 7, 4, 1, 2, 16, 'table'),
    'smaller-than-a-window': (2, 3, 4, 3, 2, 4, 'frozen'),
    'window-only': (6, 6, 3, 0, 0, 8, None),
    'window-1': (2, 2, 1, 1, 1, 4, 'grad'),
    'strided-views': (4, 5, 3, 2, 1, 4, 'table'),
}
STRIDED = {'strided-views'}


def window_bias(table, window):
    """``(heads, w*w, (w + 2p)**2)`` window RPB gathered from a ``(rows, heads)`` table, as the backbone does."""
    return table[long_short_rpb_index(window).to(table.device)].permute(2, 0, 1)


def case_inputs(name, dtype, device='cpu', seed=0):
    """Leaf tensors of a case and the op on them: ``(leaves, op)``, ``op(impl)`` the output."""
    height, width, window, rank, num_global, dim, bias = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    n, span = height * width, window + 2 * segment_pad(window)

    def leaf(*shape, requires_grad=True):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(device).requires_grad_(requires_grad)

    leaves = []
    if name in STRIDED:
        qkv = leaf(BATCH, num_global + n, 3, HEADS, dim)
        projected = leaf(BATCH, rank, 2, HEADS, dim)
        leaves += [qkv, projected]
        q, k, v = (qkv[:, num_global:, i].transpose(1, 2) for i in range(3))
        global_k, global_v = (qkv[:, :num_global, i].transpose(1, 2) for i in (1, 2))
        k_bar, v_bar = (projected[:, :, i].transpose(1, 2) for i in range(2))
    else:
        q, k, v = (leaf(BATCH, HEADS, n, dim) for _ in range(3))
        k_bar, v_bar = leaf(BATCH, HEADS, rank, dim), leaf(BATCH, HEADS, rank, dim)
        global_k, global_v = leaf(BATCH, HEADS, num_global, dim), leaf(BATCH, HEADS, num_global, dim)
        leaves += [q, k, v] + ([k_bar, v_bar] if rank else []) + ([global_k, global_v] if num_global else [])
    table = leaf(long_short_rpb_table_size(window), HEADS) if bias == 'table' else None
    local_bias = None
    if bias in ('grad', 'frozen'):
        local_bias = leaf(HEADS, window**2, span**2, requires_grad=bias == 'grad')
    leaves += [t for t in (table, local_bias) if t is not None and t.requires_grad]

    def op(impl):
        return long_short_attention(
            q,
            k,
            v,
            height,
            width,
            window,
            k_bar=k_bar if rank else None,
            v_bar=v_bar if rank else None,
            global_k=global_k if num_global else None,
            global_v=global_v if num_global else None,
            local_bias=window_bias(table, window) if table is not None else local_bias,
            impl=impl,
        )

    return leaves, op


@pytest.mark.parametrize('name', CASES)
def test_interpreted_kernels_match_math(name, interpreted):
    assert_kernels_matched(interpreted[name], dict.fromkeys(KERNELS, 1))


@pytest.mark.parametrize('name', DETERMINISTIC_CASES)
def test_deterministic_algorithms_sum_the_bias_gradient_without_atomics(name, interpreted):
    """Under torch.use_deterministic_algorithms the window-RPB gradient comes from the kernel without atomics
    (the same bits on every run), equal to the math path's; the other gradients are unchanged."""
    assert_no_error(interpreted['deterministic'])  # the comparisons run as one: an error is all of theirs
    assert_kernels_matched(interpreted['deterministic'][name], dict.fromkeys(KERNELS + (BIAS_GRAD_KERNEL,), 1))


def test_backbone_attn_impl_triton_runs_the_kernels(interpreted):
    """ViLLS(attn_impl='triton'): the long-short attention of stages 1-2 and the sliding-chunk attention
    of stages 3-4 run their kernels (forward and backward once per stage), and outputs and parameter
    gradients equal the math path's."""
    assert_kernels_matched(interpreted['backbone'], dict.fromkeys(KERNELS + SLIDING_CHUNK_KERNELS, 2))


def test_malformed_shared_keys_and_bias_are_refused():
    """What only the long-short kernels refuse (the refusals both ops share: test_triton_sliding_chunk.py)."""
    ls = pytest.importorskip(MODULE)
    q = torch.zeros(1, 2, 9, 4)
    with pytest.raises(ValueError, match=r'local_bias has shape \(2, 9, 9\), not .* \(2, 9, 25\)'):
        ls.triton_long_short_attention(q, q, q, 3, 3, 3, local_bias=torch.zeros(2, 9, 9))
    with pytest.raises(ValueError, match='k_bar and v_bar must be given together'):
        ls.triton_long_short_attention(q, q, q, 3, 3, 3, k_bar=q[:, :, :2])


def test_kernels_compile_for_hopper(monkeypatch, tmp_path):
    """The launches the wrapper makes (bf16 with every input at w = 7, also under deterministic algorithms;
    fp32 with a w = 8 window alone) compile to sm_90 machine code, through Triton's bundled compiler and
    ptxas: no GPU needed."""
    ls = pytest.importorskip(MODULE)
    compiled = compiling_launches(monkeypatch, tmp_path)
    for dtype, window, rank, num_global, with_bias, deterministic in (
        (torch.bfloat16, 7, 8, 1, True, False),
        (torch.bfloat16, 7, 8, 1, True, True),
        (torch.float32, 8, 0, 0, False, False),
    ):
        height, width, dim, span = 15, 22, 32, window + 2 * segment_pad(window)

        def tokens(count):
            return torch.randn(1, 3, count, dim, dtype=dtype, requires_grad=True)

        local_bias = torch.randn(3, window**2, span**2, requires_grad=True) if with_bias else None
        out = ls.triton_long_short_attention(
            tokens(height * width),
            tokens(height * width),
            tokens(height * width),
            height,
            width,
            window,
            k_bar=tokens(rank),
            v_bar=tokens(rank),
            global_k=tokens(num_global),
            global_v=tokens(num_global),
            local_bias=local_bias,
        )
        with deterministic_algorithms(deterministic):
            out.sum().backward()
    assert [name for name, _ in compiled] == [*KERNELS, *KERNELS, BIAS_GRAD_KERNEL, *KERNELS]
    assert all(size > 0 for _, size in compiled)


# --------------------------------------------------------------------------
# Low precision: the kernels in fp32 / bf16 / fp16 against the math path in float64
# (tolerances: triton_harness.TOLERANCES)
# --------------------------------------------------------------------------
# (H, W, w, r, G): the default w = 7 on an odd map; w = 8 (384 models) on a multiple; no shared keys.
GPU_SHAPES = [(29, 37, 7, 8, 1), (32, 32, 8, 8, 2), (14, 15, 7, 0, 0)]


def long_short_errors(device, dtype, height, width, window, rank, num_global, batch=2, heads=3, dim=32):
    """:func:`triton_harness.low_precision_errors` of long-short attention with every input it has
    (projected and global keys where ``r``, ``G`` > 0): ``({'output' or input: error}, kernel launches)``."""
    gen = torch.Generator().manual_seed(0)
    span = window + 2 * segment_pad(window)
    sizes = dict(
        q=height * width,
        k=height * width,
        v=height * width,
        k_bar=rank,
        v_bar=rank,
        global_k=num_global,
        global_v=num_global,
    )
    names = [name for name, size in sizes.items() if size]
    tokens = [torch.randn(batch, heads, sizes[name], dim, generator=gen, dtype=torch.float64) for name in names]
    biases = [torch.randn(heads, window**2, span**2, generator=gen, dtype=torch.float64)]
    names.append('local_bias')

    def op(*inputs, impl):
        q, k, v, *shared = inputs
        return long_short_attention(q, k, v, height, width, window, impl=impl, **dict(zip(names[3:], shared)))

    errors, launches = low_precision_errors(op, tokens, biases, device, dtype)
    return dict(zip(['output'] + names, errors)), launches


def compare_fp16():
    """The 16-bit code path in the interpreter subprocess: fp16 (its tl.dot mishandles bf16)."""
    errors, launches = long_short_errors('cpu', torch.float16, 8, 10, 3, 2, 1, batch=1, heads=2, dim=8)
    return dict(launches=launches, errors=errors)


def test_interpreted_fp16_matches_float64_math(interpreted):
    assert_fp16_within_tolerance(interpreted['fp16'])


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', CUDA_DTYPES, ids=CUDA_DTYPE_IDS)
@pytest.mark.parametrize('shape', GPU_SHAPES, ids=lambda s: 'x'.join(map(str, s)))
def test_cuda_kernels_match_float64_math(shape, dtype):
    assert_cuda_within_tolerance(long_short_errors, dtype, 3, *shape)


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', CUDA_DTYPES, ids=CUDA_DTYPE_IDS)
def test_cuda_deterministic_bias_gradient(dtype):
    """Under deterministic algorithms: 4 kernels, within tolerance of float64 math, the same bits twice."""
    assert_cuda_deterministic(long_short_errors, dtype, 4, *GPU_SHAPES[0])


if __name__ == '__main__':
    # The interpreter subprocess of the ``interpreted`` fixture: one JSON line on stdout.
    main(
        case_inputs,
        CASES,
        backbone=lambda: compare_backbone(ViLLS),
        fp16=compare_fp16,
        deterministic=lambda: compare_deterministic(case_inputs, DETERMINISTIC_CASES),
    )
