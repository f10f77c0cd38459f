"""Registers, register spills and shared memory of every Triton kernel a backbone launches.

Each backbone runs one training step on the CPU with ``attn_impl='triton'``, in
fp32 and under bf16 autocast, with every kernel launch replaced by a compilation
for an NVIDIA GPU (sm_90, Hopper, by default) through Triton's bundled compiler;
the bundled ``ptxas -v`` then reports each kernel's registers per thread, spill
stores and loads (bytes per thread, through local memory), and Triton its shared
memory per program. No GPU is needed, and nothing is timed: spills are the
static part of a kernel's cost that can be checked anywhere, and a kernel that
spills is the first to look at once GPU timings exist. The attention outputs of
such a run are uninitialised memory (the kernels are compiled, not run); only
the launches' arguments matter.

The kernels' compile-time constants depend on the head dims, the window and the
dtype, and (Pale's and VVT's token tiles) on the map size while it is small:
``--size`` should give every stage a map of at least 16 x 16 tokens, as the
default does.

Example::

    .venv/bin/python tools/analysis/triton_resources.py --models vil-s,vvt-s --dtypes bf16
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

import _bench_common as common
import torch

from visattn_mm.models import BACKBONES, FAMILIES

# Each family's size set beside Swin-T: (class name, arch) by the tools' name.
MODELS = {family.compared_model: (family.cls.__name__, family.compared_size) for family in FAMILIES}
DTYPES = ('fp32', 'bf16')
COLUMNS = (
    'model',
    'dtype',
    'kernel',
    'head_dim',
    'tile',
    'warps',
    'stages',
    'registers',
    'spill_stores',
    'spill_loads',
    'shared_kib',
)


def compile_launch(kernel, settings, args, constexprs, capability=90):
    """Compiles one launch of ``kernel`` (``settings``: warps and stages) for ``sm_<capability>`` with
    Triton's bundled compiler, no GPU needed; the launch's scalars are not specialised (a stride of 1 stays
    an argument), inside :class:`~visattn_mm.ops.triton.host.HeadRows` and the like too.

    Returns:
        The compiled kernel (``.asm``, ``.metadata``).
    """
    from triton import compile as triton_compile
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    def signature_of(arg):
        # Leaf by leaf: Triton's mangling of a whole tuple would make its 1s compile-time constants.
        if not isinstance(arg, tuple):
            return mangle_type(arg)
        leaves = map(signature_of, arg)
        return type(arg)(*leaves) if hasattr(arg, '_fields') else tuple(leaves)

    signature = {name: signature_of(arg) for name, arg in zip(kernel.arg_names, args)}
    signature.update(dict.fromkeys(constexprs, 'constexpr'))
    return triton_compile(
        ASTSource(kernel, signature, constexprs=constexprs), target=GPUTarget('cuda', capability, 32), options=settings
    )


def code_digest(ptx):
    """The first 12 hex digits of the SHA-256 of ``ptx`` without its debug information (``.loc`` and ``.file``
    lines, comments, debug sections): equal for two sources that compile to the same code, whatever lines
    the source moved to."""
    code = re.sub(r'^\s*\.section\s+\.debug.*', '', ptx, flags=re.M | re.S)
    lines = [
        line for line in code.splitlines() if line.strip() and not line.strip().startswith(('.loc', '.file', '//'))
    ]
    return hashlib.sha256('\n'.join(lines).encode()).hexdigest()[:12]


def compiled_kernel_resources(kernel, settings, args, constexprs, capability):
    """Compiles one launch of ``kernel`` (:func:`compile_launch`) and reads its resources.

    Returns:
        dict: registers, spill stores and loads (bytes per thread), shared memory (KiB), the
        launch's warps and pipeline stages, and the :func:`code_digest` of its PTX.
    """
    from triton.backends.nvidia.compiler import get_ptxas

    binary = compile_launch(kernel, settings, args, constexprs, capability)
    ptx = binary.asm['ptx']
    target = re.search(r'^\.target (\S+)', ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, 'kernel.ptx')
        with open(path, 'w') as file:
            file.write(ptx)
        report = subprocess.run(
            [get_ptxas(capability).path, '-v', f'--gpu-name={target}', path, '-o', os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    spills = re.search(r'(\d+) bytes spill stores, (\d+) bytes spill loads', report)
    return dict(
        ptx=code_digest(ptx),
        registers=int(re.search(r'Used (\d+) registers', report).group(1)),
        spill_stores=int(spills.group(1)),
        spill_loads=int(spills.group(2)),
        shared_kib=round(binary.metadata.shared / 1024, 1),
        warps=binary.metadata.num_warps,
        stages=binary.metadata.num_stages,
    )


def kernel_resources(name, dtype, size, capability=90):
    """The resources of every distinct kernel launch of a training step of backbone ``name``.

    Args:
        name (str): A key of :data:`MODELS`.
        dtype (str): 'fp32', or 'bf16' (autocast).
        size (tuple[int, int]): Input height and width.
        capability (int): The compute capability compiled for (90: Hopper).

    Returns:
        list[dict]: One row per kernel, head-dim tile, token tile and settings (see :data:`COLUMNS`);
        of launches that differ in other constants (e.g. a stage without global tokens), the one
        that spills most.
    """
    import visattn_mm.ops.impl as impl
    import visattn_mm.ops.triton.host as host

    rows, seen = [], set()

    def compile_instead(kernel, grid, settings, *args, **constexprs):
        key = (kernel.fn.__name__, tuple(sorted(settings.items())), tuple(sorted(constexprs.items())))
        if key in seen:
            return
        seen.add(key)
        resources = compiled_kernel_resources(kernel, settings, args, constexprs, capability)
        head_dim, tile = host.launch_tiles(constexprs)
        rows.append(dict(model=name, dtype=dtype, kernel=kernel.fn.__name__, head_dim=head_dim, tile=tile, **resources))

    class_name, arch = MODELS[name]
    model = BACKBONES[class_name](arch=arch, attn_impl='triton').train()
    # With the interpreter flag on, CPU tensors take the Triton path and pass its device check; the launches
    # compile.
    saved = host.launch, impl.triton_interpreted
    host.launch, impl.triton_interpreted = compile_instead, lambda: True
    try:
        training_step(model, torch.randn(1, 3, *size), dtype)
    finally:
        host.launch, impl.triton_interpreted = saved
    worst, digests = {}, {}
    for row in rows:
        key = tuple(row[c] for c in COLUMNS[:7])
        digests.setdefault(key, set()).add(row['ptx'])
        if key not in worst or row['spill_stores'] > worst[key]['spill_stores']:
            worst[key] = row
    # The code of every launch a row stands for, as one digest.
    return [dict(row, ptx=code_digest('\n'.join(sorted(digests[key])))) for key, row in worst.items()]


def training_step(model, image, dtype):
    """Forward (under autocast for 'bf16') and backward of the sum of the output maps' means."""
    with common.autocast(image.device, dtype):
        outputs = model(image)
    sum(out.float().mean() for out in outputs).backward()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default=','.join(MODELS), help=f'comma-separated, of {", ".join(MODELS)}')
    parser.add_argument('--dtypes', default=','.join(DTYPES), help='comma-separated, of fp32, bf16')
    parser.add_argument('--size', default='256x256', help='input HxW of the training step (default 256x256)')
    parser.add_argument('--capability', type=int, default=90, help='compute capability compiled for (default 90)')
    parser.add_argument(
        '--ptx',
        action='store_true',
        help="add a column 'ptx': a digest of the code of the row's launches without debug information, "
        'equal where a change of the kernels\' source leaves the compiled code as it was',
    )
    args = parser.parse_args(argv)
    args.models = common.check_choices(common.parse_list(args.models, str, '--models'), MODELS, '--models')
    args.dtypes = common.check_choices(common.parse_list(args.dtypes, str, '--dtypes'), DTYPES, '--dtypes')
    args.size = common.parse_size(args.size, '--size')
    return args


def main(argv=None):
    args = parse_args(argv)
    if os.environ.get('TRITON_INTERPRET'):
        sys.exit('unset TRITON_INTERPRET: the kernels must be compilable, not interpreted')
    rows = [
        row
        for name in args.models
        for dtype in args.dtypes
        for row in kernel_resources(name, dtype, args.size, args.capability)
    ]
    print(
        f'Triton kernels of a training step at {args.size[0]}x{args.size[1]}, compiled for '
        f'sm_{args.capability} (registers per thread; spills in bytes per thread):\n'
    )
    print(common.format_table(rows, COLUMNS + ('ptx',) if args.ptx else COLUMNS))
    return rows


if __name__ == '__main__':
    main()
