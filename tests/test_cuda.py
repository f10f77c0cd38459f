"""The GPU path: backbones against the CPU float64 reference, detectors and a segmentor trained
and evaluated with ``--amp`` through the tools, and ``tools/dist_train.sh`` with NCCL.

Tests marked ``cuda`` are skipped without a GPU, with the reason (``tests/conftest.py``); run them
on a GPU machine with ``bash tools/run_tests.sh -m cuda``. The backbone comparison runs on the
CPU too (the same test body, ``device='cpu'``), so its code is exercised where CI has no GPU.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys

import pytest
import torch
from mmengine.config import Config

from helpers import TINY_ARCHS
from paths import ROOT
from tool_runs import TOOLS, _free_port, _log_text, _run, _test_metrics, _tool
from visattn_mm import toy_data as toy
from visattn_mm.models import PaleTransformer, ViL, ViLLS, VVT
from visattn_mm.ops import attention_impl

CUDA = pytest.mark.cuda

# --------------------------------------------------------------------------
# Backbones against the float64 reference
# --------------------------------------------------------------------------
AUTOCAST_DTYPES = dict(fp32=None, bf16=torch.bfloat16, fp16=torch.float16)
# Largest relative error ||x - ref|| / ||ref|| per precision, of each output, of the input's
# gradient and of all gradients together; twice that for each attention bias table's gradient.
# Measured on the CPU (tiny presets of ViL / ViL-LS and the one-block archs of all four, 64x64
# and 45x71): outputs 4e-7 / 1e-2 / 1.2e-3 (fp32 / bf16 / fp16), all gradients 2e-6 / 1.6e-2 /
# 2.6e-2 (VVT), bias tables up to 3.6e-2 in bf16. fp32 leaves room for TF32-level rounding in
# case a fused CUDA kernel uses tensor cores. A wrong result (a bad mask, a lost bias, a
# transposed layout) is off by order 1. Parameter gradients are not compared one by one: some
# are ill-conditioned (VVT's q projection: a 1e-3 change of the input changes its gradient by
# ~100% in float64; a bias right before a BatchNorm has a gradient of rounding noise).
TOLERANCES = dict(fp32=5e-3, bf16=6e-2, fp16=5e-2)
# Every torch path a backbone has: the softmax attentions have two; vicinity attention has one (its
# torch ops, whatever the value; tests/test_ops/test_vicinity.py checks its opt-in bf16 products).
IMPLS = {ViL: ('math', 'fast'), ViLLS: ('math', 'fast'), PaleTransformer: ('math', 'fast'), VVT: ('fast',)}
# On CUDA each backbone also runs its Triton kernels: these cases are part of the evidence the CUDA
# defaults table asks of 'triton' (visattn_mm.ops.cuda_defaults).
CASES = [(cls, impl) for cls, impls in IMPLS.items() for impl in (*impls, 'triton')]
SIZES = ((64, 64), (45, 71))  # square, and odd and non-square (padded in every stage)
CPU_SIZE = (33, 47)  # odd and non-square too, cheaper


def forward_backward(model, image, autocast_dtype=None):
    """Outputs and gradients (input first, then every parameter) of a fixed weighted sum of the
    outputs, all as float64 CPU tensors."""
    image = image.detach().clone().requires_grad_()
    autocast = torch.autocast(image.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with autocast:
        outs = model(image)
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(out.shape, generator=gen, dtype=torch.float64) for out in outs]
    loss = sum((out.double() * w.to(out.device)).sum() for out, w in zip(outs, weights))
    names, params = zip(*model.named_parameters())
    grads = torch.autograd.grad(loss, (image, *params))
    as_cpu = [t.detach().double().cpu() for t in (*outs, *grads)]
    keys = [f'output {i}' for i in range(len(outs))] + ['grad input'] + [f'grad {n}' for n in names]
    return dict(zip(keys, as_cpu))


@functools.lru_cache(maxsize=None)
def reference(cls, size, device):
    """The model for ``device`` (float32, on the CPU, no stochastic depth), an input, and the
    float64 CPU results. The GPU runs the tiny presets; the CPU run, which keeps this test's
    code checked where there is no GPU, the one-block archs of tests/helpers.py, whose float64
    reference is cheap."""
    torch.manual_seed(0)
    model = cls(arch='tiny' if device == 'cuda' else TINY_ARCHS[cls], drop_path_rate=0.0).train()
    image = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(2))
    with attention_impl('math'):
        expected = forward_backward(copy.deepcopy(model).double(), image.double())
    return model, image, expected


def relative_errors(results, expected):
    """``{check: (||x - ref|| / ||ref||, allowed multiple of the tolerance)}``: each output,
    the input gradient, all gradients together and each attention bias table's gradient."""

    def error(keys):
        diff = sum((results[k] - expected[k]).norm() ** 2 for k in keys) ** 0.5
        return (diff / sum(expected[k].norm() ** 2 for k in keys) ** 0.5).item()

    checks = {key: (error([key]), 1) for key in expected if key.startswith('output')}
    checks['grad input'] = (error(['grad input']), 1)
    checks['all gradients'] = (error([k for k in expected if k.startswith('grad')]), 1)
    # (A table whose reference gradient is zero, e.g. g2g of a single global token, has no signal.)
    checks.update(
        {key: (error([key]), 2) for key, ref in expected.items() if 'relative_position_bias' in key and ref.norm() > 0}
    )
    return checks


@pytest.fixture
def exact_fp32_matmuls():
    """No TF32 in matmuls and convolutions while a test runs (cuDNN allows it by default)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def backbone_params():
    """Every case on CUDA; on the CPU, a check of the test's code kept cheap: the last path of each
    backbone in fp32 at ``CPU_SIZE`` (test_fast_paths.py and test_training_reliability.py cover
    the CPU's paths and bf16 / fp16)."""
    params = [
        pytest.param(
            'cuda', cls, impl, dtype, size, marks=CUDA, id=f'cuda-{cls.__name__}-{impl}-{dtype}-{size[0]}x{size[1]}'
        )
        for cls, impl in CASES
        for dtype in AUTOCAST_DTYPES
        for size in SIZES
    ]
    return params + [
        pytest.param('cpu', cls, impls[-1], 'fp32', CPU_SIZE, id=f'cpu-{cls.__name__}-{impls[-1]}-fp32')
        for cls, impls in IMPLS.items()
    ]


@pytest.mark.parametrize('device,cls,impl,dtype,size', backbone_params())
def test_backbone_matches_float64_reference(device, cls, impl, dtype, size, exact_fp32_matmuls):
    """Forward + backward on ``device`` (fp32, or bf16 / fp16 autocast) against float64 on the CPU:
    the outputs, the input's gradient, all gradients, the attention bias tables' gradients."""
    model, image, expected = reference(cls, size, device)
    model = copy.deepcopy(model).to(device)
    if device == 'cuda':
        torch.cuda.reset_peak_memory_stats()
    with attention_impl(impl):
        results = forward_backward(model, image.to(device), AUTOCAST_DTYPES[dtype])
    if device == 'cuda':
        assert torch.cuda.max_memory_allocated() > 0  # the model really ran on the GPU
    tolerance = TOLERANCES[dtype]
    failed = {
        key: error
        for key, (error, factor) in relative_errors(results, expected).items()
        if not error <= factor * tolerance
    }
    assert not failed, (tolerance, failed)


@CUDA
@pytest.mark.parametrize('impl', ['fast', 'math', 'triton'])
@pytest.mark.parametrize('cls', [ViL, ViLLS, PaleTransformer, VVT], ids=lambda cls: cls.__name__)
def test_training_step_never_waits_for_the_gpu(cls, impl):
    """A bf16 training step (ViL's random shift on) and an evaluation run under PyTorch's sync debug
    mode 'error' once first steps have cached the per-size constants: no op makes the host wait for
    the GPU (tests/test_models/test_backbone_contract.py checks the same ops on the CPU)."""
    shift = dict(random_shift=True) if issubclass(cls, ViL) else {}
    model = cls(arch='tiny', attn_impl=impl, **shift).cuda()
    image = torch.randn(2, 3, 93, 141, device='cuda')
    # Random shift draws one of 8 neighbour sets per block and step, and each set's constants are
    # made at its first use: the first steps use each set once, and the evaluation's.
    shifting = [(module, module.shift_mode) for module in model.modules() if getattr(module, 'random_shift', False)]

    def train_and_evaluate():
        model.train()
        with torch.autocast('cuda', dtype=torch.bfloat16):
            loss = sum(out.float().sum() for out in model(image))
        loss.backward()
        model.eval()
        with torch.no_grad():
            model(image)

    for shift_mode in range(9) if shifting else [None]:
        for module, _ in shifting:
            module.random_shift, module.shift_mode = False, shift_mode
        train_and_evaluate()
    for module, evaluation_mode in shifting:
        module.random_shift, module.shift_mode = True, evaluation_mode
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode('error')
    try:
        train_and_evaluate()
    finally:
        torch.cuda.set_sync_debug_mode('default')


# --------------------------------------------------------------------------
# Training and evaluation through the tools, with --amp
# --------------------------------------------------------------------------
E2E_BACKBONES = ('vil_s', 'pale_t', 'vvt_s', 'vil_ls_s')
E2E_CONFIGS = [
    f'{task}_{backbone}_{schedule}.py'
    for backbone in E2E_BACKBONES
    for task, schedule in (('maskrcnn', '1x'), ('retinanet', '1x'), ('upernet', '160k_ade20k'))
]


@pytest.fixture(scope='module')
def toy_data(tmp_path_factory):
    root = tmp_path_factory.mktemp('toy')
    return dict(
        mmdet=toy.make_coco_instances(root / 'coco', num_train=4, num_val=2),
        mmseg=toy.make_ade20k_layout(root / 'ade', num_train=4, num_val=2),
    )


def toy_config(name, toy_data, max_iters=1):
    """``configs/<name>`` on the toy data as a short run (:func:`visattn_mm.toy_data.write_toy_config`):
    ``max_iters`` iterations, a checkpoint at the end, every detection kept at test time (an untrained
    RetinaNet scores below the configs' thresholds). Pipelines, model and optimiser stay the config's."""
    scope = Config.fromfile(ROOT / 'configs' / name).default_scope
    return toy.write_toy_config(ROOT / 'configs' / name, toy_data[scope], iters=max_iters)


@CUDA
@pytest.mark.parametrize('name', E2E_CONFIGS)
def test_train_and_test_with_amp(name, toy_data, tmp_path):
    """One AMP iteration with tools/train.py, then tools/test.py on its checkpoint: the loss
    scaler was saved (AmpOptimWrapper trained), mmcv's ops ran on the GPU, metrics came out."""
    config = toy_config(name, toy_data)
    work_dir = tmp_path / 'work'
    _run(_tool('train.py', config, '--work-dir', work_dir, '--amp'), cwd=ROOT, timeout=900)
    checkpoint = torch.load(work_dir / 'iter_1.pth', map_location='cpu', weights_only=False)
    assert 'loss_scaler' in checkpoint['optimizer']
    log = _log_text(work_dir)
    assert 'MMCV ops: import; built with CUDA' in log and 'run on cuda' in log, log[-3000:]
    test_dir = tmp_path / 'test'
    _run(_tool('test.py', config, work_dir / 'iter_1.pth', '--work-dir', test_dir), cwd=ROOT, timeout=900)
    metrics = _test_metrics(test_dir)
    expected = 'mIoU' if name.startswith('upernet') else 'coco/bbox_mAP'
    assert expected in metrics, metrics


@CUDA
def test_dist_train_one_gpu_with_nccl(toy_data, tmp_path):
    """``tools/dist_train.sh CONFIG 1``: torchrun, one process, the configs' NCCL backend."""
    config = toy_config('maskrcnn_vil_s_1x.py', toy_data, max_iters=2)
    assert Config.fromfile(config).env_cfg.dist_cfg.backend == 'nccl'
    work_dir = tmp_path / 'work'
    proc = _run(
        ['bash', str(TOOLS / 'dist_train.sh'), str(config), '1', '--work-dir', str(work_dir)],
        cwd=ROOT,
        timeout=900,
        env=dict(PORT=str(_free_port()), PYTHON=sys.executable),
    )
    assert "using backend 'gloo'" not in proc.stderr
    log = _log_text(work_dir)
    assert 'Distributed training: True' in log and "'backend': 'nccl'" in log, log[-3000:]
    assert (work_dir / 'iter_2.pth').is_file()
