"""The 16-bit softmax kernels under one launch setting, against float64, at kernel and backbone level.

``python results/gpu_2026-11-26/call4/launch_matrix.py SETTING`` on a GPU, from the repository root, with
SETTING ``package`` (the package's own) or e.g. ``4w3s`` (4 warps, 3 pipeline stages for every 16-bit
launch). ``run.sh`` beside it ran six settings side by side on the H200 (2026-11-26, call 4; at that
commit ``launch_settings`` also took the head-dim tile, and 'package' meant 8 warps at head dim 64; its
logs also hold a case without global tokens, which the harness cannot run and which is left out here).
"""

import copy
import sys
import time
import traceback

import torch

sys.path[:0] = ['tests']
from test_cuda import forward_backward, reference, relative_errors  # noqa: E402
from test_triton_kernels import BACKBONE_STAGE_SHAPE, GPU_SHAPE, sliding_chunk_errors  # noqa: E402
from test_triton_long_short import long_short_errors  # noqa: E402

from visattn_mm.models import ViL, ViLLS  # noqa: E402
from visattn_mm.ops import attention_impl  # noqa: E402
from visattn_mm.ops.triton import host  # noqa: E402

BF16 = torch.bfloat16
TOLERANCES = {torch.bfloat16: 6e-2, torch.float16: 5e-2}  # tests/test_cuda.py's
KERNEL_CASES = {
    'sc 3x5 d64 bf16': lambda: sliding_chunk_errors('cuda', BF16, 0, 0, BACKBONE_STAGE_SHAPE),
    'sc 3x5 d32 bf16': lambda: sliding_chunk_errors('cuda', BF16, 0, 0, dict(BACKBONE_STAGE_SHAPE, dim=32)),
    'sc 29x37 d64 bf16': lambda: sliding_chunk_errors('cuda', BF16, 0, 0, dict(GPU_SHAPE, dim=64)),
    'sc 14x14 d64 bf16': lambda: sliding_chunk_errors('cuda', BF16, 0, 0, dict(GPU_SHAPE, height=14, width=14, dim=64)),
    'sc 3x5 d64 fp16': lambda: sliding_chunk_errors('cuda', torch.float16, 0, 0, BACKBONE_STAGE_SHAPE),
    'ls 3x5 d64 bf16': lambda: long_short_errors('cuda', BF16, 3, 5, 7, 8, 1, dim=64),
    'ls 29x37 d64 bf16': lambda: long_short_errors('cuda', BF16, 29, 37, 7, 8, 1, dim=64),
    'ls 3x5 d32 bf16': lambda: long_short_errors('cuda', BF16, 3, 5, 7, 8, 1, dim=32),
}
BACKBONE_CASES = [
    (cls, size, dtype)
    for cls in (ViL, ViLLS)
    for size, dtype in (((45, 71), BF16), ((64, 64), BF16), ((45, 71), torch.float16))
]


def use_setting(label):
    """Every 16-bit launch with ``label``'s warps and stages (fp32 keeps the package's)."""
    if label == 'package':
        return
    warps, stages = (int(part) for part in label.rstrip('s').split('w'))
    package = host.launch_settings
    host.launch_settings = lambda dtype: (
        dict(num_warps=warps, num_stages=stages) if dtype.itemsize == 2 else package(dtype)
    )


def kernel_case(label, name, errors_and_launches):
    start = time.time()
    try:
        errors, launches = errors_and_launches()
    except Exception as error:  # a CUDA error sticks to the process: stop there
        print(f'{label} {name}: ERROR {type(error).__name__}: {str(error)[:200]}', flush=True)
        if 'CUDA' in str(error):
            sys.exit(1)
        return
    worst = max(errors, key=errors.get)
    print(
        f'{label} {name}: worst {worst} {errors[worst]:.3g}; output {errors["output"]:.3g}; '
        f'launches {launches} ({time.time() - start:.0f} s)',
        flush=True,
    )


def backbone_case(label, cls, size, dtype):
    start = time.time()
    try:
        model, image, expected = reference(cls, size, 'cuda')
        with attention_impl('triton'):
            results = forward_backward(copy.deepcopy(model).cuda(), image.cuda(), dtype)
    except Exception as error:
        print(f'{label} {cls.__name__} {dtype} {size}: ERROR {type(error).__name__}: {str(error)[:300]}', flush=True)
        traceback.print_exc(limit=-6)
        sys.exit(1)
    errors = relative_errors(results, expected)
    over = {key: round(error, 3) for key, (error, factor) in errors.items() if error > factor * TOLERANCES[dtype]}
    worst = max(errors, key=lambda key: errors[key][0])
    print(
        f'{label} {cls.__name__} {dtype} {size}: worst {worst} {errors[worst][0]:.3g}; over tolerance {over} '
        f'({time.time() - start:.0f} s)',
        flush=True,
    )


if __name__ == '__main__':
    setting = sys.argv[1]
    use_setting(setting)
    print(setting, 'bf16:', host.launch_settings(BF16), flush=True)
    for case_name, case in KERNEL_CASES.items():
        kernel_case(setting, case_name, case)
    for cls, size, dtype in BACKBONE_CASES:
        backbone_case(setting, cls, size, dtype)
