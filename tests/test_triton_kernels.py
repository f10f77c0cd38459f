"""The Triton sliding-chunk kernels (``impl='triton'``) against the math path.

Triton decides whether a ``@triton.jit`` kernel is compiled or interpreted when
the kernel is defined, from ``TRITON_INTERPRET``. The CPU comparisons therefore
run in one subprocess that starts with ``TRITON_INTERPRET=1`` and imports the
kernels there (this file run as a script); this process keeps them compiled for
the compile check and the GPU test. Every case compares, in float64, the output
and the gradients of every input with the math path, and counts the launches of
each kernel to prove which path ran.
"""
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from visattn_mm.collect_env import attention_paths
from visattn_mm.ops import ATTENTION_IMPLS, attention_impl
from visattn_mm.ops.impl import chosen_path
from visattn_mm.ops.rel_pos import NEIGHBOUR_OFFSETS, sliding_chunk_rpb_index
from visattn_mm.ops.sliding_chunk import sliding_chunk_attention

ROOT = Path(__file__).resolve().parents[1]
MODULE = 'visattn_mm.ops.triton_sliding_chunk'
KERNELS = ('_sliding_chunk_forward', '_sliding_chunk_backward_queries', '_sliding_chunk_backward_keys')
BATCH, HEADS = 2, 2

# name: (H, W, w, masking_mode, shift_mode, globals, head dim, local bias, l2g bias)
# local bias: 'grad' (a leaf), 'frozen' (no gradient), 'table' (gathered from an RPB table, like the
# backbones), None. 'strided' cases take q, k, v and the global tokens as views of one qkv tensor.
CASES = {
    'odd-non-square': (5, 7, 3, 0, 0, 1, 4, 'grad', True),
    'cyclic': (9, 9, 3, -1, 0, 2, 8, 'grad', True),
    'exact-window': (5, 7, 3, 1, 0, 0, 16, 'grad', False),
    'exact-window-tile-sized-chunk': (8, 7, 4, 1, 0, 1, 4, 'table', True),
    'shift-3': (7, 8, 3, 0, 3, 1, 5, 'grad', True),
    'shift-8': (7, 8, 3, 0, 8, 2, 4, 'grad', True),
    'own-chunk-only': (7, 8, 3, 0, -1, 2, 4, None, False),
    'cyclic-shift-5': (9, 9, 3, -1, 5, 1, 4, 'grad', True),
    'cyclic-2x2-grid': (4, 5, 3, -1, 0, 1, 4, 'grad', True),
    'shorter-than-a-chunk': (2, 5, 3, 0, 0, 2, 4, 'frozen', True),
    'window-2-no-l2g': (3, 5, 2, 0, 0, 1, 6, 'grad', False),
    'strided-views': (4, 5, 3, 0, 0, 1, 4, 'table', True),
}
STRIDED = {'strided-views'}


def case_inputs(name, dtype, device='cpu', seed=0):
    """Leaf tensors of a case and the op on them: ``(leaves, op)``, ``op(impl)`` the output."""
    height, width, window, masking_mode, shift_mode, num_global, dim, bias, has_l2g = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    n, w2 = height * width, window ** 2

    def leaf(*shape, requires_grad=True):
        return torch.randn(*shape, generator=gen, dtype=dtype).to(device).requires_grad_(requires_grad)

    leaves = []
    if name in STRIDED:
        # Like the backbones: the heads split from one projection, the global tokens first.
        qkv = leaf(BATCH, num_global + n, 3, HEADS, dim)
        leaves.append(qkv)
        q, k, v = (qkv[:, num_global:, i].transpose(1, 2) for i in range(3))
        global_k = qkv[:, :num_global, 1].transpose(1, 2)
        global_v = qkv[:, :num_global, 2].transpose(1, 2)
    else:
        q, k, v = leaf(BATCH, HEADS, n, dim), leaf(BATCH, HEADS, n, dim), leaf(BATCH, HEADS, n, dim)
        global_k, global_v = leaf(BATCH, HEADS, num_global, dim), leaf(BATCH, HEADS, num_global, dim)
        leaves += [q, k, v] + ([global_k, global_v] if num_global else [])
    table = leaf((4 * window - 1) ** 2, HEADS) if bias == 'table' else None
    local_bias = None
    if bias in ('grad', 'frozen'):
        local_bias = leaf(HEADS, w2, 9 * w2, requires_grad=bias == 'grad')
    l2g_bias = leaf(HEADS, num_global) if has_l2g and num_global else None
    leaves += [t for t in (table, local_bias, l2g_bias) if t is not None and t.requires_grad]

    def op(impl):
        bias_table = local_bias
        if table is not None:
            index = sliding_chunk_rpb_index(window).to(table.device)
            bias_table = table[index].reshape(w2, 9 * w2, HEADS).permute(2, 0, 1)
        return sliding_chunk_attention(
            q, k, v, height, width, window, global_k=global_k if num_global else None,
            global_v=global_v if num_global else None, local_bias=bias_table, l2g_bias=l2g_bias,
            masking_mode=masking_mode, shift_mode=shift_mode, impl=impl)

    return leaves, op


def forward_backward(leaves, op, impl, launches):
    """Output and leaf gradients of a fixed weighted sum of ``op(impl)``; kernel launches it made."""
    before = dict(launches)
    out = op(impl)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad((out * weights.to(out)).sum(), leaves)
    return out, grads, {name: launches[name] - before.get(name, 0) for name in KERNELS}


def compare_case(name):
    """Runs one case on both paths (in the interpreter subprocess): launches and mismatches."""
    from visattn_mm.ops.triton_sliding_chunk import INTERPRETED, KERNEL_LAUNCHES
    assert INTERPRETED, 'the kernels must run in the interpreter here'
    leaves, op = case_inputs(name, torch.float64)
    math_out, math_grads, math_launches = forward_backward(leaves, op, 'math', KERNEL_LAUNCHES)
    out, grads, launches = forward_backward(leaves, op, 'triton', KERNEL_LAUNCHES)
    mismatches = []
    for label, actual, expected in [('output', out, math_out)] + [
            (f'grad {i} {tuple(g.shape)}', g, m) for i, (g, m) in enumerate(zip(grads, math_grads))]:
        try:
            torch.testing.assert_close(actual, expected, rtol=1e-10, atol=1e-10)
        except AssertionError as error:
            mismatches.append(f'{label}: {error}')
    return dict(math_launches=math_launches, launches=launches, mismatches=mismatches)


def compare_backbone():
    """A tiny ViL with attn_impl='triton' against the same weights with 'math' (interpreter subprocess)."""
    from helpers import VIL_TINY_ARCH

    from visattn_mm.models import ViL
    from visattn_mm.ops.triton_sliding_chunk import KERNEL_LAUNCHES
    image = torch.randn(1, 3, 32, 48, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    results = {}
    for attn_impl in ('math', 'triton'):
        torch.manual_seed(0)
        model = ViL(arch=VIL_TINY_ARCH, attn_impl=attn_impl, drop_path_rate=0.0).double().eval()
        before = sum(KERNEL_LAUNCHES.values())
        outs = model(image)
        grads = torch.autograd.grad(sum(o.pow(2).mean() for o in outs), list(model.parameters()))
        results[attn_impl] = outs, grads, sum(KERNEL_LAUNCHES.values()) - before
    mismatches = []
    for i, (a, b) in enumerate(zip([*results['triton'][0], *results['triton'][1]],
                                   [*results['math'][0], *results['math'][1]])):
        try:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
        except AssertionError as error:
            mismatches.append(f'tensor {i}: {error}')
    return dict(math_launches=results['math'][2], launches=results['triton'][2], mismatches=mismatches)


def run_all():
    """Every case and the backbone, each caught separately: ``{name: result or {'error': text}}``."""
    results = {}
    for name, compare in [*((name, lambda name=name: compare_case(name)) for name in CASES),
                          ('backbone', compare_backbone), ('fp16', compare_fp16)]:
        try:
            results[name] = compare()
        except Exception:   # reported per case by the parent
            results[name] = dict(error=traceback.format_exc())
    return results


@pytest.fixture(scope='module')
def interpreted():
    """Results of :func:`run_all` in a subprocess with Triton's interpreter on."""
    pytest.importorskip('triton')
    env = dict(os.environ, TRITON_INTERPRET='1', PYTHONPATH=os.pathsep.join(
        [str(ROOT), str(ROOT / 'tests'), os.environ.get('PYTHONPATH', '')]))
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize('name', CASES)
def test_interpreted_kernels_match_math(name, interpreted):
    result = interpreted[name]
    assert 'error' not in result, result.get('error')
    assert result['math_launches'] == dict.fromkeys(KERNELS, 0)
    assert result['launches'] == dict.fromkeys(KERNELS, 1)
    assert not result['mismatches'], '\n'.join(result['mismatches'])


def test_backbone_attn_impl_triton_runs_the_kernels(interpreted):
    """ViL(attn_impl='triton'): every sliding-chunk attention runs the kernels (forward and backward
    once per stage) and outputs and parameter gradients equal the math path's."""
    result = interpreted['backbone']
    assert 'error' not in result, result.get('error')
    assert result['math_launches'] == 0 and result['launches'] == 3 * 4
    assert not result['mismatches'], '\n'.join(result['mismatches'])


def test_block_offsets_match_neighbour_order():
    """The kernels compute block b's chunk offset as (b // 3 - 1, b % 3 - 1)."""
    assert NEIGHBOUR_OFFSETS == tuple((b // 3 - 1, b % 3 - 1) for b in range(9))


def test_triton_is_opt_in_and_taken_only_where_it_runs(monkeypatch):
    from visattn_mm.models.layers import check_attn_impl
    assert 'triton' in ATTENTION_IMPLS and check_attn_impl('triton', 'ViL') == 'triton'
    monkeypatch.delenv('TRITON_INTERPRET', raising=False)
    with attention_impl('auto'):
        assert chosen_path('cuda', True, op='sliding_chunk') == 'fast'            # 'auto' never picks it
        assert chosen_path('cuda', True, impl='triton', op='sliding_chunk') == 'triton'
        assert chosen_path('cuda', True, impl='triton', op='long_short') == 'fast'   # no kernel: as 'auto'
        assert chosen_path('cpu', True, impl='triton', op='sliding_chunk') == 'math'
        assert chosen_path('cpu', False, impl='triton', op='sliding_chunk') == 'fast'
    with attention_impl('triton'):
        assert chosen_path('cuda', op='sliding_chunk') == 'triton'
        assert attention_paths('cuda')['ViLLS'] == 'long_short fast, sliding_chunk triton'   # the env report
        assert attention_paths('cpu')['ViL'] == 'sliding_chunk math (training) / fast (inference)'
        monkeypatch.setenv('TRITON_INTERPRET', '1')
        assert chosen_path('cpu', op='sliding_chunk') == 'triton'


def test_refusals_name_the_alternative(monkeypatch):
    ts = pytest.importorskip(MODULE)
    q = torch.zeros(1, 1, 9, 4)
    with pytest.raises(ValueError, match="dropout.*'fast' or 'math'"):
        ts.triton_sliding_chunk_attention(q, q, q, 3, 3, 3, dropout_p=0.1)
    with pytest.raises(ValueError, match='masking_mode=1'):
        ts.triton_sliding_chunk_attention(q, q, q, 3, 3, 3, masking_mode=1, shift_mode=2)
    monkeypatch.setattr(ts, 'INTERPRETED', False)
    with pytest.raises(RuntimeError, match="CUDA tensors.*'fast' or 'math'"):
        ts.triton_sliding_chunk_attention(q, q, q, 3, 3, 3)


def test_missing_triton_names_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, 'triton', None)      # makes `import triton` fail
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    with pytest.raises(ImportError, match=r"impl 'triton' needs the triton package.*pip install triton"):
        __import__(MODULE)


def test_kernels_compile_for_hopper(monkeypatch, tmp_path):
    """The launches the wrapper makes (bf16 with every feature; fp32 cyclic with a shift) compile to
    sm_90 machine code, through Triton's bundled compiler and ptxas: no GPU needed."""
    ts = pytest.importorskip(MODULE)
    if ts.INTERPRETED:
        pytest.skip('TRITON_INTERPRET is on in this process: the kernels are not compilable objects')
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    compiled = []

    def compile_instead(kernel, grid, num_warps, *args, **constexprs):
        signature = {name: mangle_type(arg) for name, arg in zip(kernel.arg_names, args)}
        signature.update(dict.fromkeys(constexprs, 'constexpr'))
        binary = triton_compile(ASTSource(kernel, signature, constexprs=constexprs),
                                target=GPUTarget('cuda', 90, 32), options=dict(num_warps=num_warps))
        compiled.append((kernel.fn.__name__, len(binary.asm['cubin'])))

    monkeypatch.setenv('TRITON_CACHE_DIR', str(tmp_path))   # compile for real, not from a cache
    monkeypatch.setattr(ts, '_launch', compile_instead)
    monkeypatch.setattr(ts, 'INTERPRETED', True)            # CPU tensors pass the device check
    for dtype, masking_mode, shift_mode in ((torch.bfloat16, 1, 0), (torch.float32, -1, 3)):
        height, width, window, dim = 15, 22, 7, 32
        q, k, v = (torch.randn(1, 3, height * width, dim, dtype=dtype, requires_grad=True) for _ in range(3))
        global_k, global_v = (torch.randn(1, 3, 1, dim, dtype=dtype, requires_grad=True) for _ in range(2))
        local_bias = torch.randn(3, window ** 2, 9 * window ** 2, requires_grad=True)
        l2g_bias = torch.randn(3, 1, requires_grad=True)
        out = ts.triton_sliding_chunk_attention(q, k, v, height, width, window, global_k=global_k,
                                                global_v=global_v, local_bias=local_bias, l2g_bias=l2g_bias,
                                                masking_mode=masking_mode, shift_mode=shift_mode)
        out.sum().backward()
    assert [name for name, _ in compiled] == list(KERNELS) * 2
    assert all(size > 0 for _, size in compiled)


# --------------------------------------------------------------------------
# Low precision: the kernels in fp32 / bf16 / fp16 against the math path in float64
# --------------------------------------------------------------------------
GPU_SHAPE = dict(batch=2, heads=3, height=29, width=37, window=7, dim=32, num_global=1)
# Relative error ||x - ref|| / ||ref|| of the output and of each gradient. fp32 products are full
# fp32 ('highest' matmul precision); 16-bit runs round the inputs, the probabilities and the logit
# gradients. Measured in the interpreter (fp16, 8x10 map, w 3): at most 1.4e-3 (the l2g gradient, a
# sum with cancellation); bf16 has 3 mantissa bits fewer. A wrong mask or layout is off by order 1.
TOLERANCES = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-2}


def low_precision_errors(device, dtype, masking_mode, shift_mode, shape):
    """Relative errors of the Triton path on ``device`` with tokens in ``dtype`` and fp32 biases
    (what the backbones pass under autocast) against the math path in float64 on the same rounded
    values: ``({input or 'output': error}, kernel launches)``."""
    from visattn_mm.ops.triton_sliding_chunk import KERNEL_LAUNCHES
    gen = torch.Generator().manual_seed(0)
    n, w2, s = shape['height'] * shape['width'], shape['window'] ** 2, shape
    tokens = [torch.randn(s['batch'], s['heads'], size, s['dim'], generator=gen).to(dtype).double()
              for size in (n, n, n, s['num_global'], s['num_global'])]
    biases = [torch.randn(s['heads'], w2, 9 * w2, generator=gen, dtype=torch.float64),
              torch.randn(s['heads'], s['num_global'], generator=gen, dtype=torch.float64)]

    def run(inputs, impl):
        inputs = [t.detach().requires_grad_() for t in inputs]
        q, k, v, global_k, global_v, local_bias, l2g_bias = inputs
        before = sum(KERNEL_LAUNCHES.values())
        out = sliding_chunk_attention(q, k, v, s['height'], s['width'], s['window'], global_k=global_k,
                                      global_v=global_v, local_bias=local_bias, l2g_bias=l2g_bias,
                                      masking_mode=masking_mode, shift_mode=shift_mode, impl=impl)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        grads = torch.autograd.grad((out.double() * weights.to(out.device)).sum(), inputs)
        return [t.double().cpu() for t in (out, *grads)], sum(KERNEL_LAUNCHES.values()) - before

    reference, _ = run(tokens + biases, 'math')
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision('highest')
    try:
        results, launches = run([t.to(device, dtype) for t in tokens]
                                + [b.to(device, torch.float32) for b in biases], 'triton')
    finally:
        torch.set_float32_matmul_precision(previous)
    labels = ['output', 'q', 'k', 'v', 'global_k', 'global_v', 'local_bias', 'l2g_bias']
    errors = {label: ((r - ref).norm() / ref.norm()).item() for label, r, ref in zip(labels, results, reference)}
    return errors, launches


def compare_fp16():
    """The 16-bit code path in the interpreter subprocess: fp16 (its tl.dot mishandles bf16)."""
    shape = dict(batch=1, heads=2, height=8, width=10, window=3, dim=8, num_global=1)
    errors, launches = low_precision_errors('cpu', torch.float16, 1, 0, shape)
    return dict(launches=launches, errors=errors)


def test_interpreted_fp16_matches_float64_math(interpreted):
    result = interpreted['fp16']
    assert 'error' not in result, result.get('error')
    assert result['launches'] == 3
    assert max(result['errors'].values()) < TOLERANCES[torch.float16], result['errors']


@pytest.mark.cuda
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16], ids=['fp32', 'bf16'])
@pytest.mark.parametrize('masking_mode,shift_mode', [(0, 0), (-1, 0), (1, 0), (0, 4), (-1, 7), (0, -1)])
def test_cuda_kernels_match_float64_math(masking_mode, shift_mode, dtype):
    ts = pytest.importorskip(MODULE)
    if ts.INTERPRETED:
        pytest.skip('TRITON_INTERPRET is on in this process')
    errors, launches = low_precision_errors('cuda', dtype, masking_mode, shift_mode, GPU_SHAPE)
    assert launches == 3
    assert max(errors.values()) < TOLERANCES[dtype], errors


if __name__ == '__main__':
    # The interpreter subprocess of the ``interpreted`` fixture: one JSON line on stdout.
    print(json.dumps(run_all()))
