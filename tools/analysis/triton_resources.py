"""Registers, register spills and shared memory of every Triton kernel a backbone launches.

Each backbone runs one training step on the CPU with ``attn_impl='triton'``, in
fp32 and under bf16 autocast, with every kernel launch replaced by a compilation
for an NVIDIA GPU (sm_90, Hopper, by default) through Triton's bundled compiler;
the bundled ``ptxas -v`` then reports each kernel's registers per thread, spill
stores and loads (bytes per thread, through local memory), and Triton its shared
memory per program. The models (:data:`MODELS`) are the compared backbones and
VVT-S with its opt-in fused conv-FFN (``vvt-s-fused``: ``fused_conv_gelu=True``),
the one model that launches the depthwise-conv+GELU kernels of
:mod:`visattn_mm.ops.conv_gelu`. No GPU is needed, and nothing is timed: spills
are the static part of a kernel's cost that can be checked anywhere, and a
kernel that spills is the first to look at once GPU timings exist. The attention outputs of
such a run are uninitialised memory (the kernels are compiled, not run); only
the launches' arguments matter.

The kernels' compile-time constants depend on the head dims, the window and the
dtype, and (Pale's and VVT's token tiles) on the map size while it is small:
``--size`` should give every stage a map of at least 16 x 16 tokens, as the
default does.

``--deterministic`` runs the steps under ``torch.use_deterministic_algorithms``, so that the report
includes the kernels that then sum the RPB gradients without atomics (``ops.triton.host.bias_grad_parts``).

``--digests write`` puts each op's :func:`op_digests` (at the defaults: every backbone, fp32 and bf16,
256x256, sm_90) into ``visattn_mm/ops/kernel_digests.py``, the compiled code that the CUDA defaults table's
rows are checked against; ``--digests check`` exits 1 where that file is stale. Kernels of ops without rows there
(:data:`OPS_WITHOUT_DEFAULTS`: conv_gelu) are reported but not digested.

Example::

    .venv/bin/python tools/analysis/triton_resources.py --models vil-s,vvt-s --dtypes bf16
    .venv/bin/python tools/analysis/triton_resources.py --digests write   # after changing a kernel
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

import torch

from visattn_mm.analysis import benchmarking as bench
from visattn_mm.analysis.benchmark_backbones import COMPARED_MODELS, FUSED, MODEL_ZOO, training_step
from visattn_mm.analysis.benchmark_backbones import TRITON_DTYPES as DTYPES
from visattn_mm.models import BACKBONES
from visattn_mm.ops import kernel_digests
from visattn_mm.ops.specs import OP_NAMES

DEFAULT_SIZE = '256x256'
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGESTS_FILE = os.path.join(ROOT, 'visattn_mm', 'ops', 'kernel_digests.py')
DIGESTS_COMMAND = '.venv/bin/python tools/analysis/triton_resources.py --digests write'
#: name -> (class name, arch, options): the compared backbones, and each one's fused variant of
#: :data:`~visattn_mm.analysis.benchmark_backbones.MODEL_ZOO` (VVT's ``fused_conv_gelu=True``), whose opt-in kernels
#: no other model launches.
MODELS = {name: (class_name, arch, {}) for name, (class_name, arch) in COMPARED_MODELS.items()}
MODELS.update(
    {
        name + FUSED: (class_name, arch, dict(fused_conv_gelu=True))
        for name, (class_name, arch) in COMPARED_MODELS.items()
        if name + FUSED in MODEL_ZOO
    }
)
#: Ops whose kernels have no row in the CUDA defaults table (the fused depthwise-conv+GELU, which VVT runs only
#: where it is asked to): no digest, since nothing checks one, and their kernel changes leave the table current.
OPS_WITHOUT_DEFAULTS = ('conv_gelu',)
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
    lines, comments, debug sections, and the ``$L__tmp`` labels that mark inlined helpers' ranges for them):
    equal for two sources that compile to the same code, whatever lines the source moved to and whichever
    helpers it was split into."""
    code = re.sub(r'^\s*\.section\s+\.debug.*', '', ptx, flags=re.M | re.S)
    lines = [
        line
        for line in code.splitlines()
        if line.strip()
        and not line.strip().startswith(('.loc', '.file', '//'))
        and not re.fullmatch(r'\$L__tmp\d+:', line.strip())
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


def kernel_resources(name, dtype, size, capability=90, deterministic=False):
    """The resources of every distinct kernel launch of a training step of backbone ``name``.

    Args:
        name (str): A key of :data:`MODELS`.
        dtype (str): 'fp32', or 'bf16' (autocast).
        size (tuple[int, int]): Input height and width.
        capability (int): The compute capability compiled for (90: Hopper).
        deterministic (bool): Run the step under ``torch.use_deterministic_algorithms`` (warn only).

    Returns:
        list[dict]: One row per kernel, head-dim tile, token tile and settings (see :data:`COLUMNS`; and
        ``op``, the op whose module defines the kernel, ``ptx``, the :func:`code_digest` of the code of the
        row's launches, and ``launches``, each launch's); of launches that differ in other constants (e.g. a
        stage without global tokens), the one that spills most.
    """
    import visattn_mm.ops.impl as impl
    import visattn_mm.ops.triton.host as host

    rows, seen = [], set()

    def compile_instead(kernel, grid, settings, *args, **constexprs):
        settings = host.tuned_settings(kernel, settings, args, constexprs)
        key = (kernel.fn.__name__, tuple(sorted(settings.items())), tuple(sorted(constexprs.items())))
        if key in seen:
            return
        seen.add(key)
        resources = compiled_kernel_resources(kernel, settings, args, constexprs, capability)
        head_dim, tile = host.launch_tiles(constexprs)
        op = kernel.fn.__module__.split('.')[-2]  # visattn_mm.ops.<op>.triton
        rows.append(
            dict(model=name, dtype=dtype, kernel=kernel.fn.__name__, op=op, head_dim=head_dim, tile=tile, **resources)
        )

    class_name, arch, options = MODELS[name]
    model = BACKBONES[class_name](arch=arch, attn_impl='triton', **options).train()
    # With the interpreter flag on, CPU tensors take the Triton path and pass its device check; the launches
    # compile.
    saved = host.launch, impl.triton_interpreted
    host.launch, impl.triton_interpreted = compile_instead, lambda: True
    try:
        with bench.deterministic_algorithms(deterministic):
            training_step(model, torch.randn(1, 3, *size), dtype)
    finally:
        host.launch, impl.triton_interpreted = saved
    worst, digests = {}, {}
    for row in rows:
        key = tuple(row[c] for c in COLUMNS[:7])
        digests.setdefault(key, set()).add(row['ptx'])
        if key not in worst or row['spill_stores'] > worst[key]['spill_stores']:
            worst[key] = row
    # The code of every launch a row stands for, as one digest, and each launch's.
    return [
        dict(row, ptx=code_digest('\n'.join(sorted(digests[key]))), launches=tuple(sorted(digests[key])))
        for key, row in worst.items()
    ]


def op_digests(rows):
    """One digest per op of the code of its kernels: of every distinct launch's code in ``rows``, however the rows
    group the launches and whichever backbones launched them; in the order of
    :data:`visattn_mm.ops.specs.OP_NAMES`. Ops without rows in the CUDA defaults table
    (:data:`OPS_WITHOUT_DEFAULTS`) are left out: no row is checked against their code.

    Args:
        rows (list[dict]): Rows of :func:`kernel_resources`.

    Returns:
        dict: ``{op: digest}``.

    Raises:
        ValueError: For kernels of an op that neither the spec table nor :data:`OPS_WITHOUT_DEFAULTS` names.
    """
    codes = {}
    for row in rows:
        if row['op'] not in OPS_WITHOUT_DEFAULTS:
            codes.setdefault(row['op'], set()).update(row['launches'])
    unknown = set(codes) - set(OP_NAMES)
    if unknown:
        raise ValueError(
            f'kernels of {sorted(unknown)}, which the spec table (visattn_mm.ops.specs) lacks: add the op there '
            '(or, without defaults-table rows, to OPS_WITHOUT_DEFAULTS)'
        )
    return {op: code_digest('\n'.join(sorted(codes[op]))) for op in OP_NAMES if op in codes}


def digest_changes(digests, committed=None):
    """Where ``digests`` differ from the committed table's, one line per op; empty where the table is current.

    Args:
        digests (dict): ``{op: digest}`` of :func:`op_digests`.
        committed (dict, optional): The table's ``{op: digest}``. Default:
            :data:`visattn_mm.ops.kernel_digests.KERNEL_DIGESTS`.
    """
    committed = kernel_digests.KERNEL_DIGESTS if committed is None else committed
    return [
        f'{op}: the table says {committed.get(op)}, its kernels compile to {digests.get(op)}'
        for op in dict.fromkeys([*committed, *digests])
        if committed.get(op) != digests.get(op)
    ]


DIGESTS_DOC = '''"""The compiled code of each op's Triton kernels in this tree, one digest per op: a measured row of
the CUDA defaults table (:mod:`visattn_mm.ops.cuda_defaults`) whose recorded digest differs runs 'fast'.

Generated, not edited: ``{command}`` compiles every
kernel launch of a training step of each backbone ({size}, fp32 and bf16 autocast) for sm_{capability} under
Triton {triton} and digests each op's code without its debug lines (``op_digests``);
tests/test_ops/test_triton/test_triton_resources.py fails while this file is stale.
"""
'''


def digests_source(digests, triton_version, capability):
    """The text of ``visattn_mm/ops/kernel_digests.py``.

    Args:
        digests (dict): ``{op: digest}`` of :func:`op_digests`.
        triton_version (str): The Triton that compiled the kernels.
        capability (int): The compute capability they were compiled for.
    """
    doc = DIGESTS_DOC.format(command=DIGESTS_COMMAND, size=DEFAULT_SIZE, capability=capability, triton=triton_version)
    entries = [f'    {op}={digest!r},' for op, digest in digests.items()]
    code = [f'TRITON = {triton_version!r}', f'CAPABILITY = {capability}', 'KERNEL_DIGESTS = dict(', *entries, ')']
    return doc + '\n' + '\n'.join(code) + '\n'


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default=','.join(MODELS), help=f'comma-separated, of {", ".join(MODELS)}')
    parser.add_argument('--dtypes', default=','.join(DTYPES), help='comma-separated, of fp32, bf16')
    parser.add_argument('--size', default=DEFAULT_SIZE, help=f'input HxW of the training step (default {DEFAULT_SIZE})')
    parser.add_argument('--capability', type=int, default=90, help='compute capability compiled for (default 90)')
    parser.add_argument(
        '--ptx',
        action='store_true',
        help="add a column 'ptx': a digest of the code of the row's launches without debug information, "
        'equal where a change of the kernels\' source leaves the compiled code as it was',
    )
    parser.add_argument(
        '--deterministic',
        action='store_true',
        help='run the steps under torch.use_deterministic_algorithms (the RPB gradients without atomics)',
    )
    parser.add_argument(
        '--digests',
        choices=('check', 'write'),
        help=f"each op's digest of its kernels' code against {DIGESTS_FILE}: 'check' exits 1 where it is stale, "
        "'write' writes it (at the default models, dtypes, size and capability only)",
    )
    args = parser.parse_args(argv)
    args.models = bench.check_choices(bench.parse_list(args.models, str, '--models'), MODELS, '--models')
    args.dtypes = bench.check_choices(bench.parse_list(args.dtypes, str, '--dtypes'), DTYPES, '--dtypes')
    args.size = bench.parse_size(args.size, '--size')
    defaults = (list(MODELS), list(DTYPES), bench.parse_size(DEFAULT_SIZE, '--size'), parser.get_default('capability'))
    if args.digests and (
        (list(args.models), list(args.dtypes), args.size, args.capability) != defaults or args.deterministic
    ):
        parser.error(
            '--digests covers every kernel at the defaults: leave --models, --dtypes, --size, --capability '
            'and --deterministic out'
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    if os.environ.get('TRITON_INTERPRET'):
        sys.exit('unset TRITON_INTERPRET: the kernels must be compilable, not interpreted')
    rows = [
        row
        for name in args.models
        for dtype in args.dtypes
        for row in kernel_resources(name, dtype, args.size, args.capability, args.deterministic)
    ]
    print(
        f'Triton kernels of a training step at {args.size[0]}x{args.size[1]}, compiled for '
        f'sm_{args.capability} (registers per thread; spills in bytes per thread):\n'
    )
    print(bench.format_table(rows, COLUMNS + ('ptx',) if args.ptx else COLUMNS))
    if args.digests:
        check_or_write_digests(op_digests(rows), args.digests, args.capability)
    return rows


def check_or_write_digests(digests, action, capability, path=DIGESTS_FILE):
    """Writes ``digests`` into the table, or exits 1 naming each op where they differ from it (the kernels
    compiled by another Triton than the table's count as differing).

    Args:
        digests (dict): ``{op: digest}`` of :func:`op_digests`.
        action (str): 'write' or 'check'.
        capability (int): The compute capability they were compiled for.
        path (str): The table's file (written; named in the check's message).
    """
    import triton

    if action == 'write':
        with open(path, 'w') as file:
            file.write(digests_source(digests, triton.__version__, capability))
        print(f'\nwrote the kernel digests of {", ".join(digests)} into {path}')
        return
    changes = digest_changes(digests)
    if triton.__version__ != kernel_digests.TRITON:
        changes.append(f'the table was compiled by Triton {kernel_digests.TRITON}, this is {triton.__version__}')
    if changes:
        sys.exit('\n'.join([f'{path} is stale:', *changes, f'regenerate it: {DIGESTS_COMMAND}']))
    print(f'\n{path} is current')


if __name__ == '__main__':
    main()
