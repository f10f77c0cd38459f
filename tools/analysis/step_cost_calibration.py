"""The step-cost tracer against an H100: traced peaks next to the peaks measured there.

The H100 figures are measured facts (``docs/benchmarks_history.md``, "Step-cost calibration against an H100"):
forward + backward, batch 8, 800x1333, bf16 autocast, ``max_memory_allocated`` above the
memory before the call, with our backbones as they were at commit ``MEASURED_AT``. So
the baselines are traced as they are (their code is the pinned timm's and mmdet's),
and our backbones as they were then: their package is taken from git at that commit
(``git archive``) and traced in a subprocess by today's tracer, with the commit's
fused-path choice answered as for CUDA tensors (then ``use_fast_path``, which the
tracer's ``dispatch_as`` replaces today). Without git or that commit in the clone, the
backbones' rows say so and only the baselines are compared.

Example::

    .venv/bin/python tools/analysis/step_cost_calibration.py
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os.path as osp
import subprocess
import sys
import tarfile
import tempfile
import types

# Nothing of the package is imported at the top: worker() runs this file under the package of an older commit.
ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
MEASURED_AT = 'e939d0f'
# Peak MiB measured on the H100 (torch 2.11, 2026-11-23), fwd+bwd, batch 8, 800x1333, bf16 autocast.
H100_PEAK_MIB = {'swin-t': 12082, 'r50': 4451, 'vil-s': 19251, 'vil-ls-s': 17983, 'pale-t': 14559, 'vvt-s': 37548}
BASELINES = ('swin-t', 'r50')
# Pinned with the measurement (not visattn_mm.models.FAMILIES): the calibration builds these in the tree
# of MEASURED_AT, which predates the family table.
OURS = {'vil-s': ('ViL', 's'), 'vil-ls-s': ('ViLLS', 's'), 'pale-t': ('PaleTransformer', 't'), 'vvt-s': ('VVT', 's')}
INPUT_SHAPE = (8, 3, 800, 1333)
MIB = 2**20
# Run by trace_ours_at in a subprocess whose path starts with the old package: this file, loaded by its path.
WORKER_CODE = (
    'import importlib.util, sys; '
    "spec = importlib.util.spec_from_file_location('step_cost_calibration', sys.argv[1]); "
    'module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); module.worker(sys.argv[2:])'
)


def trace_peak_mib(model):
    """Peak MiB of one traced step at the H100's setting."""
    from visattn_mm.analysis.step_cost import trace_step

    model.train()
    return trace_step(model, INPUT_SHAPE, dtype='bf16', mode='fwd+bwd', device_type='cuda').peak_bytes / MIB


def trace_baselines():
    """``{name: traced peak MiB}`` of the baselines, built as ``step_cost_report.py`` builds them
    (``visattn_mm.analysis.benchmark_backbones.build_backbone``)."""
    from visattn_mm.analysis.benchmark_backbones import build_backbone

    return {name: trace_peak_mib(build_backbone(name)) for name in BASELINES}


def _load_tracer_into(package):
    """Today's tracer as ``<package>.analysis.step_cost`` of an older package, with the two names it
    imports from the package supplied where the old package lacks them."""
    from visattn_mm.ops import common as ops_common
    from visattn_mm.ops import impl

    if not hasattr(ops_common, 'clear_device_caches'):

        def clear_device_caches():
            for module in list(sys.modules.values()):
                if getattr(module, '__name__', '').startswith('visattn_mm.ops.'):
                    for value in vars(module).values():
                        getattr(value, 'cache_clear', lambda: None)()

        ops_common.clear_device_caches = clear_device_caches
    if not hasattr(impl, 'dispatch_as'):
        impl.dispatch_as = lambda device_type: contextlib.nullcontext()
    analysis = types.ModuleType(f'{package}.analysis')
    analysis.__path__ = []
    sys.modules[analysis.__name__] = analysis
    spec = importlib.util.spec_from_file_location(
        f'{package}.analysis.step_cost', osp.join(ROOT, 'visattn_mm', 'analysis', 'step_cost.py')
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


def _answer_fused_choice_as_cuda():
    """The old ops asked ``use_fast_path(tensor, *biases)``, which looked at the tensors' device: on CUDA
    the answer was always the fused path."""
    for name, module in list(sys.modules.items()):
        if name.startswith('visattn_mm.ops.') and hasattr(module, 'use_fast_path'):
            module.use_fast_path = lambda tensor, *biases, **kwargs: True


def worker(models):
    """Run in a subprocess whose ``sys.path`` starts with the old package: prints ``{name: MiB}`` as JSON."""
    import visattn_mm.models as models_module
    import visattn_mm.ops.long_short  # noqa: F401  (loaded, so that their choice is patched)
    import visattn_mm.ops.pale  # noqa: F401
    import visattn_mm.ops.sliding_chunk  # noqa: F401

    _load_tracer_into('visattn_mm')
    _answer_fused_choice_as_cuda()
    peaks = {}
    for name in models:
        class_name, arch = OURS[name]
        peaks[name] = trace_peak_mib(getattr(models_module, class_name)(arch=arch))
    print(json.dumps(peaks))


def trace_ours_at(commit, models):
    """``{name: traced peak MiB}`` of our backbones at ``commit``, or a string saying why there are none."""
    with tempfile.TemporaryDirectory() as tree:
        archive = osp.join(tree, 'package.tar')
        made = subprocess.run(
            ['git', 'archive', '-o', archive, commit, 'visattn_mm'], cwd=ROOT, capture_output=True, text=True
        )
        if made.returncode != 0:
            return f'git cannot give the package at {commit}: {made.stderr.strip() or made.stdout.strip()}'
        with tarfile.open(archive) as tar:
            tar.extractall(tree, filter='data')
        run = subprocess.run(
            [sys.executable, '-c', WORKER_CODE, osp.abspath(__file__), *models],
            capture_output=True,
            text=True,
            cwd=tree,
            env={**__import__('os').environ, 'PYTHONPATH': tree},
        )
        if run.returncode != 0:
            raise RuntimeError(f'tracing the backbones at {commit} failed:\n{run.stderr[-3000:]}')
        return json.loads(run.stdout.strip().splitlines()[-1])


def calibration_rows(models=tuple(OURS), commit=MEASURED_AT):
    """Rows ``model, code, measured_mib, traced_mib, error`` (relative); ``error`` None where not traced."""
    traced = trace_baselines()
    ours = trace_ours_at(commit, list(models)) if models else {}
    rows = []
    for name in (*BASELINES, *models):
        value = traced.get(name) if name in BASELINES else (ours.get(name) if isinstance(ours, dict) else None)
        measured = H100_PEAK_MIB[name]
        rows.append(
            dict(
                model=name,
                code='today' if name in BASELINES else commit,
                measured_mib=measured,
                traced_mib=value,
                error=None if value is None else value / measured - 1,
                note='' if value is not None else ours,
            )
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', default=','.join(OURS), help=f'our backbones, from {", ".join(OURS)}')
    args = parser.parse_args(argv)
    from visattn_mm.analysis import benchmarking as bench

    models = bench.check_choices(bench.parse_list(args.models, option='--models'), OURS, '--models')
    rows = calibration_rows(models)
    shown = [
        dict(
            row,
            traced_mib=None if row['traced_mib'] is None else round(row['traced_mib']),
            error=None if row['error'] is None else f"{row['error']:+.1%}",
        )
        for row in rows
    ]
    print(bench.format_table(shown, ('model', 'code', 'measured_mib', 'traced_mib', 'error', 'note')))
    return rows


if __name__ == '__main__':
    main()
