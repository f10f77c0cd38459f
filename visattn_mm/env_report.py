"""The environment report of ``tools/collect_env.py`` and of every ``tools/train.py`` run.

:func:`collect_env` is mmcv's report (the system, PyTorch, compilers, mmengine,
mmcv and the compiler / CUDA version its ops were built with) plus
:func:`plugin_env`: the CUDA build of torch, the GPUs, whether mmcv's compiled
ops import and run on the GPU, the versions of the OpenMMLab libraries, timm
and Triton (``attn_impl='triton'``) with the digest of each op's compiled kernels (which a GPU session's
report hands to the CUDA defaults table's rows), and the attention path each backbone takes (see
:mod:`visattn_mm.ops.impl`). ``tools/train.py`` logs :func:`plugin_env` after
the Runner has logged the system part.
"""

from __future__ import annotations

import importlib

import torch

from .models import BACKBONES
from .ops import kernel_digests
from .ops.cuda_defaults import describe_cuda_defaults
from .ops.impl import chosen_path, dispatch_device_type, get_attention_impl

LIBRARIES = (
    ('MMDetection', 'mmdet'),
    ('MMSegmentation', 'mmseg'),
    ('timm', 'timm'),
    ('Triton', 'triton'),
    ('visattn_mm', 'visattn_mm'),
)
#: The report's entry of the kernel digests, which tools/analysis/decide_cuda_defaults.py reads from a GPU call's log.
KERNEL_DIGESTS_KEY = 'Triton kernel digests'


def _version(module_name):
    try:
        return importlib.import_module(module_name).__version__
    except ImportError as error:
        return f'not installed ({error})'


def mmcv_ops_status():
    """Whether mmcv's compiled ops import, the CUDA they were built with, and whether they run on the GPU.

    mmdet calls these ops (RoIAlign, NMS) as soon as a detector runs; an mmcv
    built without CUDA fails on the first GPU batch, which one NMS of two boxes
    on the GPU finds out here first.

    Returns:
        str: e.g. ``'import; built with CUDA 12.1; run on cuda'``, or what fails.
    """
    try:
        from mmcv.ops import get_compiling_cuda_version, nms
    except ImportError as error:
        return f'do not import ({error}); reinstall mmcv with its compiled ops (tools/bootstrap.sh)'
    built_with = get_compiling_cuda_version()
    status = 'import; ' + ('built without CUDA' if built_with == 'not available' else f'built with CUDA {built_with}')
    if not torch.cuda.is_available():
        return status
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 10.0, 10.0]], device='cuda')
    try:
        nms(boxes, torch.tensor([0.9, 0.8], device='cuda'), iou_threshold=0.5)
    except (RuntimeError, NotImplementedError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f'{status}; FAIL on cuda ({reason}): rebuild mmcv with CUDA ops (tools/bootstrap.sh on this machine)'
    return f'{status}; run on cuda'


def attention_paths(device_type):
    """``{backbone: 'op: path, ...'}``: the attention path each backbone takes on ``device_type``.

    Under the current selection (``get_attention_impl()``); where training and
    inference differ, both are named. On CUDA, 'auto' is reported per dtype, with the row of
    the defaults table (:mod:`visattn_mm.ops.cuda_defaults`) that decides it.
    """
    lines = {}
    follows_table = dispatch_device_type(device_type) == 'cuda' and get_attention_impl() == 'auto'
    for backbone, cls in BACKBONES.items():
        parts = []
        for spec in cls.attention_ops:
            op = spec.name
            if follows_table:
                parts.append(describe_cuda_defaults(op))
                continue
            if not spec.softmax:  # the Triton kernels or torch ops
                parts.append(f'{op} ' + ('triton' if chosen_path(device_type, op=op) == 'triton' else 'torch ops'))
                continue
            train, infer = chosen_path(device_type, spec.trained_bias, op=op), chosen_path(device_type, False, op=op)
            parts.append(f'{op} {train}' if train == infer else f'{op} {train} (training) / {infer} (inference)')
        lines[backbone] = ', '.join(parts)
    return lines


def plugin_env(device_type=None):
    """What this plugin depends on beyond mmcv's report.

    Args:
        device_type (str, optional): Device the attention paths are reported for.
            Default: ``'cuda'`` when a GPU is visible, else ``'cpu'``.

    Returns:
        dict[str, str]: Ordered entries; the attention ones are keyed
        ``'attention <backbone>'``.
    """
    device_type = device_type or ('cuda' if torch.cuda.is_available() else 'cpu')
    env = {
        'PyTorch': torch.__version__,
        'PyTorch CUDA build': torch.version.cuda or 'none (CPU-only build)',
        'CUDA devices': str(torch.cuda.device_count()),
    }
    for index in range(torch.cuda.device_count()):
        env[f'GPU {index}'] = (
            f'{torch.cuda.get_device_name(index)}, compute capability '
            f'{".".join(map(str, torch.cuda.get_device_capability(index)))}'
        )
    env['MMCV'] = _version('mmcv')
    env['MMCV ops'] = mmcv_ops_status()
    env['MMEngine'] = _version('mmengine')
    for name, module in LIBRARIES:
        env[name] = _version(module)
    env[KERNEL_DIGESTS_KEY] = (
        ', '.join(f'{op}={digest}' for op, digest in kernel_digests.KERNEL_DIGESTS.items())
        + f' (sm_{kernel_digests.CAPABILITY}, Triton {kernel_digests.TRITON}: visattn_mm/ops/kernel_digests.py)'
    )
    env['attention implementation'] = f'{get_attention_impl()} (VISATTN_ATTENTION_IMPL), paths on {device_type}:'
    for backbone, paths in attention_paths(device_type).items():
        env[f'attention {backbone}'] = paths
    return env


def collect_env():
    """mmcv's environment report (mmengine's where mmcv is missing) followed by :func:`plugin_env`."""
    try:
        from mmcv.utils import collect_env as base_collect_env
    except ImportError:
        from mmengine.utils.dl_utils import collect_env as base_collect_env
    return {**base_collect_env(), **plugin_env()}


def format_env(env):
    """``key: value`` lines, as mmengine's Runner logs its environment."""
    return '\n'.join(f'{key}: {value}' for key, value in env.items())
