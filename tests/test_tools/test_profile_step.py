"""tools/analysis/profile_step.py: the kernel classes of real-looking CUDA kernel names and CPU op names,
our Triton kernels as read from the source against the imported modules, the per-class sums, and the
whole tool on the CPU at a tiny size (the GPU session's smoke runs it too: test_gpu_session.py)."""

from __future__ import annotations

import csv
import importlib

import pytest
import torch

from tool_runs import _load_tool
from visattn_mm.ops.specs import OP_NAMES

profile_step = _load_tool('analysis/profile_step')

OWN = profile_step.own_kernels()

# Names as torch.profiler reports them on an H100 / H200 (demangled; arguments shortened where long).
KERNEL_NAMES = (
    (
        'sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1'
        '_execute_segment_k_off_kernel__5x_cublas',
        'gemm',
    ),
    ('nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT', 'gemm'),
    (
        'void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>'
        '(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8::Params)',
        'gemm',
    ),
    (
        'void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>'
        '(cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*)',
        'gemm',
    ),
    (
        'sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64_warpgroupsize1x1x1'
        '_g1_execute_kernel__5x_cudnn',
        'conv',
    ),
    ('sm80_xmma_wgrad_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize64x64x64_stage4', 'conv'),
    (
        'void cudnn::engines_precompiled::nchwToNhwcKernel<__nv_bfloat16, __nv_bfloat16, float, false, true, '
        '(cudnnKernelDataType_t)0>(cudnn::engines_precompiled::nchw2nhwc_params_t<float>, __nv_bfloat16 const*)',
        'conv',
    ),
    (
        'void cutlass__5x_cudnn::Kernel<cutlass_tensorop_s1688fprop_optimized_tf32_64x64_16x10_nhwc_align4>(Params)',
        'conv',
    ),
    (
        'void at::native::(anonymous namespace)::conv_depthwise2d_backward_kernel<3, 1, c10::BFloat16, int>'
        '(at::GenericPackedTensorAccessor<c10::BFloat16 const, 4ul>, int, int, int, int)',
        'conv',
    ),
    (
        'fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, '
        'cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)',
        'sdpa',
    ),
    (
        'fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<'
        'cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 64, false>::Params)',
        'sdpa',
    ),
    ('void pytorch_flash::flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8>, true>(Params)', 'sdpa'),
    (
        'void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float, false>'
        '(int, float, float const*, float const*, float const*, float*, float*, float*)',
        'norm',
    ),
    (
        'void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<float, float, 32u, 32u, '
        '256u, false, true, true>(long, long, float const*, float const*, float const*, float*, float*)',
        'norm',
    ),
    (
        'void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<float, float>(long, float, float const*)',
        'norm',
    ),
    (
        'void at::native::batch_norm_collect_statistics_channels_last_kernel<at::native::Var, c10::BFloat16, '
        'float, 4>(c10::BFloat16 const*, int, int, float, float*, float*)',
        'norm',
    ),
    ('void cudnn::bn_fw_tr_1C11_kernel_NCHW<__nv_bfloat16, float, float, 512, true, 1>(float, float)', 'norm'),
    (
        'void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, '
        'at::native::(anonymous namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)',
        'softmax',
    ),
    (
        'void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16_copy_kernel_cuda('
        'at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul> >(int, '
        'at::native::bfloat16_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda(float)#1}, std::array<char*, 2ul>)',
        'cast',
    ),
    (
        'void at::native::vectorized_elementwise_kernel<4, at::native::bfloat16tofloat32_copy_kernel_cuda('
        'at::TensorIteratorBase&)::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int)',
        'cast',
    ),
    (
        'void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)'
        '::{lambda()#3}::operator()() const::{lambda()#7}::operator()() const::{lambda(float)#1}, '
        'std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, '
        'TrivialOffsetCalculator<1, unsigned int>, '
        'at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int)',
        'cast',
    ),
    (
        'void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<'
        'at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::'
        '{lambda()#12}::operator()() const::{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&)::{lambda(int)#1}>(int)',
        'copy',
    ),
    (
        'void at::native::(anonymous namespace)::CatArrayBatchedCopy_contig<at::native::(anonymous namespace)::'
        'OpaqueType<2u>, unsigned int, 4, 128, 1>(at::native::(anonymous namespace)::OpaqueType<2u>*)',
        'copy',
    ),
    ('Memcpy DtoD (Device -> Device)', 'copy'),
    ('void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...>>(long)', 'copy'),
    (
        'void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >'
        '(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)',
        'fill',
    ),
    ('Memset (Device)', 'fill'),
    (
        'void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, '
        'float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float>>)',
        'reduction',
    ),
    (
        'void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, '
        'std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)',
        'elementwise',
    ),
    (
        'void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, '
        'at::native::GeluType)::{lambda()#2}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >'
        '(int)',
        'elementwise',
    ),
    ('triton_poi_fused_add_gelu_native_layer_norm_0', 'inductor'),
    ('a_kernel_nobody_named', 'other'),
    # Ours: the Triton kernels by their function names, and the custom ops on the CPU.
    ('_sliding_chunk_backward_keys', 'sliding_chunk:_sliding_chunk_backward_keys'),
    ('_long_short_forward', 'long_short:_long_short_forward'),
    ('_pale_backward_queries', 'pale:_pale_backward_queries'),
    ('_vicinity_forward', 'vicinity:_vicinity_forward'),
    ('visattn_mm::triton_pale_attention_backward', 'pale:visattn_mm::triton_pale_attention_backward'),
    # CPU op names.
    ('aten::addmm', 'gemm'),
    ('aten::linear', 'gemm'),
    ('aten::_slow_conv2d_forward', 'conv'),
    ('aten::mkldnn_convolution', 'conv'),
    ('aten::native_layer_norm_backward', 'norm'),
    ('aten::_scaled_dot_product_flash_attention_for_cpu', 'sdpa'),
    ('aten::_softmax', 'softmax'),
    ('aten::_to_copy', 'cast'),
    ('aten::copy_', 'copy'),
    ('aten::cat', 'copy'),
    ('aten::fill_', 'fill'),
    ('aten::sum', 'reduction'),
    ('aten::gelu', 'elementwise'),
)


@pytest.mark.parametrize('name, expected', KERNEL_NAMES, ids=[name[:48] for name, _ in KERNEL_NAMES])
def test_kernel_class_of_real_names(name, expected):
    assert profile_step.kernel_class(name, OWN) == expected


def test_every_class_is_covered_by_a_name():
    """Each class of the tables has a real name above that lands in it (a class no name reaches is dead)."""
    found = {expected for _, expected in KERNEL_NAMES}
    assert set(profile_step.KERNEL_CLASSES) <= found


def test_own_kernels_are_the_jit_functions_of_each_op_module():
    """What is read from the source is what the imported modules hold: every ``triton.jit`` function of
    each op's module (and nothing of the shared helpers, which belong to no op), and each custom op."""
    triton = pytest.importorskip('triton')
    expected = {}
    for op in OP_NAMES:
        module = importlib.import_module(f'visattn_mm.ops.{op}.triton')
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.JITFunction) and value.__module__ == module.__name__:
                expected[name] = op
        registered = f'triton_{op}_attention'
        assert hasattr(torch.ops.visattn_mm, registered) and hasattr(torch.ops.visattn_mm, f'{registered}_backward')
        expected[f'visattn_mm::{registered}'] = expected[f'visattn_mm::{registered}_backward'] = op
    assert OWN == expected
    assert '_sliding_chunk_forward' in OWN and 'softmax_step' not in OWN  # a kernel_parts helper


def test_summarize_sums_each_class_per_step():
    samples = [
        ('_pale_forward', 300.0, True),
        ('nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT', 100.0, True),
        ('nvjet_tst_64x8_64x16_4x1_v_bz_TNN', 60.0, True),
        ('Memset (Device)', 4.0, True),
        ('aten::linear', 20.0, False),  # a CPU op that called others: its own time, no launch
    ]
    classes = profile_step.summarize(samples, OWN, steps=2)
    assert list(classes) == ['pale:_pale_forward', 'gemm', 'fill']
    assert classes['gemm'] == dict(launches_per_step=1.0, time_ms_per_step=0.09)
    assert classes['pale:_pale_forward'] == dict(launches_per_step=0.5, time_ms_per_step=0.15)
    assert classes['fill']['time_ms_per_step'] == pytest.approx(0.002)


CASE = ['--models', 'vil-t', '--batches', '1', '--size', '64x64', '--threads', '1']


def test_cpu_run_writes_classes_that_add_up(tmp_path):
    """The tool end to end on the CPU (op events for kernels): one case, its totals row and its classes;
    ``--floor-only`` gives the same floor without running the step."""
    steps = ['--warmup', '0', '--steps', '1', '--profiled-steps', '1']
    rows = profile_step.main(['--device', 'cpu', *CASE, *steps, '--out-dir', str(tmp_path)])
    with open(tmp_path / 'profile_step.csv', newline='') as f:
        written = list(csv.DictReader(f))
    assert len(written) == len(rows) and written[0]['kernel_class'] == 'all'
    total, classes = rows[0], rows[1:]
    assert total['status'] == 'ok' and total['impl'] == 'auto'
    # bf16 autocast: its casts (copy_ called by _to_copy) are a class of their own.
    assert {'gemm', 'norm', 'cast', 'copy', 'elementwise'} <= {row['kernel_class'] for row in classes}
    assert sum(row['time_ms_per_step'] for row in classes) == pytest.approx(total['kernel_ms'])
    assert sum(row['launches_per_step'] for row in classes) == total['launches_per_step'] > 100
    assert sum(row['share'] for row in classes) == pytest.approx(1.0)
    # The ops' own times lie inside a step: about the wall time (less the Python between ops; the profiled
    # step runs slower than the timed one, and a shared machine adds noise).
    assert 0.1 < total['busy'] < 3
    assert total['floor_ms'] > 0 and total['wall_vs_floor'] == pytest.approx(total['wall_ms'] / total['floor_ms'])
    table = (tmp_path / 'profile_step.md').read_text()
    assert '| model | impl | batch | wall_ms |' in table and '| vil-t | auto | 1 |' in table

    (floor,) = profile_step.main(['--floor-only', *CASE, '--out-dir', str(tmp_path / 'floor')])
    assert floor['status'] == 'floor only' and floor['floor_ms'] == total['floor_ms']


def test_options_that_cannot_work_are_refused():
    with pytest.raises(SystemExit, match='leave nothing to do'):
        profile_step.parse_args(['--floor-only', '--no-floor'])
    with pytest.raises(SystemExit, match='--profiled-steps'):
        profile_step.parse_args(['--profiled-steps', '0'])
    with pytest.raises(SystemExit, match="unknown value\\(s\\) \\['vil-x'\\]"):
        profile_step.parse_args(['--models', 'swin-t,vil-x'])
