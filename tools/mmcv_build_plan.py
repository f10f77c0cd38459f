"""Which mmcv build ``tools/bootstrap.sh`` installs on this machine, and under which cache key.

mmcv 2.1.0 is built from source. Its compiled ops come in two flavours:

- ``cpu``: CPU kernels only (``FORCE_CUDA=0``). Chosen where torch sees no CUDA device, or
  where ``VISATTN_CPU_ONLY=1`` asks for it.
- ``cuda``: CPU and CUDA kernels (``FORCE_CUDA=1``), compiled for the architectures of the
  visible GPUs (``TORCH_CUDA_ARCH_LIST``, e.g. ``9.0`` on an H100). Needs ``nvcc``; a GPU
  without it is an error that names the two ways forward.

A built wheel only works with the torch, Python and CUDA it was compiled against, so the
wheel cache is keyed by all of them (pip's own cache keys by source only and would hand
a CPU build to a GPU machine, or a build for another torch).

Run by the bootstrap with the new environment's python once torch is installed; prints
``name=value`` lines: lower-case names describe the plan, upper-case ones are the
environment of the build. ``python tools/mmcv_build_plan.py`` shows the plan for the
current interpreter without building anything.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

CPU_ONLY_FLAG = 'VISATTN_CPU_ONLY'


@dataclass(frozen=True)
class Machine:
    """What the build depends on.

    Args:
        python: ``major.minor`` of the interpreter, e.g. ``'3.12'``.
        torch: ``torch.__version__``, e.g. ``'2.12.1'`` or ``'2.12.1+cu126'``.
        torch_cuda: ``torch.version.cuda`` (``None`` for a CPU-only torch).
        gpu_capabilities: ``(major, minor)`` compute capability of each CUDA device torch
            sees; empty where it sees none.
        nvcc: path of the CUDA compiler, ``None`` where there is none (looked up only
            where there is a GPU).
        nvcc_cuda: CUDA release of that compiler, e.g. ``'13.0'``.
        cores: CPU cores this process may use.
    """

    python: str
    torch: str
    torch_cuda: str | None
    gpu_capabilities: tuple[tuple[int, int], ...]
    nvcc: str | None
    nvcc_cuda: str | None
    cores: int


@dataclass(frozen=True)
class Plan:
    """How to build mmcv, where to cache the wheel, and what the stamp records.

    Args:
        flavour: ``'cpu'`` or ``'cuda'``.
        cache_key: folder name of the wheel cache entry.
        build_env: environment variables of the build.
        note: one line for the log saying why this flavour was chosen.
    """

    flavour: str
    cache_key: str
    build_env: dict[str, str]
    note: str


class PlanError(RuntimeError):
    """This machine cannot get a working mmcv without the user's help."""


def make_plan(machine: Machine, env: dict[str, str]) -> Plan:
    """Decide the mmcv flavour and its build settings.

    Args:
        machine: the facts of the machine (see :func:`describe_machine`).
        env: environment variables; read: ``VISATTN_CPU_ONLY``, and ``MAX_JOBS`` /
            ``TORCH_CUDA_ARCH_LIST`` where the user set them.

    Returns:
        The :class:`Plan`.

    Raises:
        PlanError: a GPU without ``nvcc``, or an ``nvcc`` of another CUDA major
            version than torch's.
    """
    base_key = f'torch-{machine.torch}-cp{machine.python.replace(".", "")}'
    jobs = env.get('MAX_JOBS') or str(max(1, machine.cores))
    cpu_only = env.get(CPU_ONLY_FLAG, '') not in ('', '0')
    if not machine.gpu_capabilities or cpu_only:
        why = f'{CPU_ONLY_FLAG}=1' if machine.gpu_capabilities else 'torch sees no CUDA device'
        return Plan(
            'cpu',
            f'{base_key}-cpu',
            {'MMCV_WITH_OPS': '1', 'FORCE_CUDA': '0', 'MAX_JOBS': jobs},
            f'CPU ops only ({why})',
        )

    if machine.nvcc is None:
        raise PlanError(
            f'torch sees {len(machine.gpu_capabilities)} CUDA device(s), but there is no CUDA '
            'compiler (nvcc), so mmcv cannot be built with its CUDA ops (RoIAlign, NMS, ... '
            'that mmdet runs on the GPU). Either install the CUDA toolkit '
            f'{machine.torch_cuda} that matches torch {machine.torch} (nvcc on PATH, or '
            f'CUDA_HOME set) and run again, or set {CPU_ONLY_FLAG}=1 to build the CPU ops '
            'only (models then run on the CPU).'
        )
    if _major(machine.nvcc_cuda) != _major(machine.torch_cuda):
        raise PlanError(
            f'nvcc ({machine.nvcc}) is CUDA {machine.nvcc_cuda}, but torch {machine.torch} '
            f'was built with CUDA {machine.torch_cuda}: their major versions must agree for '
            'mmcv\'s CUDA ops. Put a CUDA '
            f'{_major(machine.torch_cuda)}.x toolkit first on PATH (or CUDA_HOME), install '
            f'a torch built for CUDA {machine.nvcc_cuda}, or set {CPU_ONLY_FLAG}=1 for a '
            'CPU-only build.'
        )
    arch_list = env.get('TORCH_CUDA_ARCH_LIST') or ';'.join(
        f'{major}.{minor}' for major, minor in sorted(set(machine.gpu_capabilities))
    )
    arch_key = re.sub(r'[^0-9A-Za-z.+]+', '_', arch_list)
    return Plan(
        'cuda',
        f'{base_key}-cuda{machine.torch_cuda}-arch{arch_key}',
        {'MMCV_WITH_OPS': '1', 'FORCE_CUDA': '1', 'MAX_JOBS': jobs, 'TORCH_CUDA_ARCH_LIST': arch_list},
        f'CUDA ops for compute capability {arch_list} with {machine.nvcc} (CUDA {machine.nvcc_cuda})',
    )


def _major(version: str | None) -> str | None:
    return version.split('.')[0] if version else None


def describe_machine() -> Machine:
    """The facts of this machine, as this interpreter's torch sees them."""
    import torch

    capabilities, nvcc = (), None
    if torch.cuda.is_available():
        capabilities = tuple(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
        # Where torch's extension builder (mmcv's build) will look for it. Imported only
        # here: on a machine without a GPU it logs a warning about the missing CUDA runtime.
        from torch.utils.cpp_extension import CUDA_HOME

        if CUDA_HOME and os.access(os.path.join(CUDA_HOME, 'bin', 'nvcc'), os.X_OK):
            nvcc = os.path.join(CUDA_HOME, 'bin', 'nvcc')
        nvcc = nvcc or shutil.which('nvcc')
    return Machine(
        python=f'{sys.version_info.major}.{sys.version_info.minor}',
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        gpu_capabilities=capabilities,
        nvcc=nvcc,
        nvcc_cuda=_nvcc_release(nvcc) if nvcc else None,
        cores=len(os.sched_getaffinity(0)),
    )


def _nvcc_release(nvcc: str) -> str | None:
    """``'12.4'`` from ``nvcc --version`` ("Cuda compilation tools, release 12.4, ...")."""
    out = subprocess.run([nvcc, '--version'], capture_output=True, text=True).stdout
    found = re.search(r'release (\d+\.\d+)', out)
    return found.group(1) if found else None


def plan_lines(plan: Plan) -> list[str]:
    """The plan as the ``name=value`` lines the bootstrap reads."""
    lines = [f'flavour={plan.flavour}', f'cache_key={plan.cache_key}', f'note={plan.note}']
    return lines + [f'{name}={value}' for name, value in plan.build_env.items()]


def main() -> int:
    try:
        plan = make_plan(describe_machine(), dict(os.environ))
    except PlanError as err:
        print(f'[bootstrap] error: {err}', file=sys.stderr)
        return 2
    print('\n'.join(plan_lines(plan)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
