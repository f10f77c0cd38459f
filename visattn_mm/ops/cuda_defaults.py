"""What ``attn_impl='auto'`` runs on CUDA: one table, decided by measurement.

On a CUDA tensor, 'auto' (with no process-wide selection, see :mod:`visattn_mm.ops.impl`) takes
the path of the row of :data:`CUDA_DEFAULTS` that matches the op, the dtype of its query and its
head dim. A row names ``'triton'`` only where GPU measurements showed both (:func:`decide`):

* the CUDA-marked tests of the op's Triton kernels passed, and those of every backbone that runs the
  op on ``'triton'`` (outputs and every gradient against the float64 reference), and
* the backbone that runs the op trained (forward + backward, 800x1333) faster on ``'triton'``
  than on ``'fast'`` at batch 8 and at batch 2 (the configs' images per GPU): a ``triton / fast``
  time ratio under 1 at both.

A row holds for the kernels the GPU measured, not for their source: it records the digest of their
compiled code (:attr:`Measurement.kernel_digest`), and while the op's current digest
(:mod:`visattn_mm.ops.kernel_digests`, generated) differs, 'auto' runs ``'fast'`` for the row and its
reason says why (:attr:`CudaDefault.path`), until a GPU session has passed its CUDA tests and timed
the changed kernels.

Every other row says ``'fast'``: a measured one with the ratio that kept it there, an unmeasured
one because nothing has measured it. ``tools/analysis/decide_cuda_defaults.py`` turns the files of a
GPU session's device calls (``tools/gpu_session.sh``) into rows for this table; docs/benchmarks.md keeps the
measurements behind them.
"""

from __future__ import annotations

import dataclasses

import torch

from . import kernel_digests
from .specs import OP_NAMES, op_spec

#: The dtypes of the rows, by the name the benchmarks use.
DTYPE_NAMES = {torch.bfloat16: 'bf16', torch.float16: 'fp16', torch.float32: 'fp32'}
PATHS = ('fast', 'triton')
UNMEASURED = 'not measured on a GPU yet'
#: How a row's CUDA tests went (:attr:`Measurement.tests`), as its reason says it.
TEST_OUTCOMES = dict(
    passed='CUDA tests passed',
    failed='CUDA tests FAILED',
    incomplete='CUDA tests incomplete (none in this dtype for the op\'s kernels or a backbone that runs it)',
)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """A GPU session's evidence for one row.

    Args:
        device (str): The GPU, as torch names it.
        torch (str): torch's version there.
        triton (str): Triton's version there.
        commit (str): The repository's commit measured.
        date (str): ``YYYY-MM-DD``.
        model (str): The benchmark model whose rows decide (``tools/analysis/benchmark.py``), e.g.
            ``'vil-s'``.
        ratio_batch8 (float): ``triton / fast`` median time, forward + backward, 800x1333, batch 8.
        ratio_batch2 (float): The same at batch 2.
        tests (str): How the CUDA-marked tests in the row's dtype went, of the op's kernels and on
            ``'triton'`` of each backbone that runs the op: ``'passed'`` (each group ran and none failed),
            ``'failed'`` (one failed) or ``'incomplete'`` (none failed, but a group had no test that ran).
        kernel_digest (str | None): The digest of the compiled code of the op's Triton kernels it measured,
            as :data:`visattn_mm.ops.kernel_digests.KERNEL_DIGESTS` has them (same Triton, same target);
            None where the session did not report one, which no current digest matches.
    """

    device: str
    torch: str
    triton: str
    commit: str
    date: str
    model: str
    ratio_batch8: float
    ratio_batch2: float
    tests: str
    kernel_digest: str | None


@dataclasses.dataclass(frozen=True)
class CudaDefault:
    """One row: what 'auto' runs on CUDA for ``op`` on ``dtype`` queries with a head dim in
    ``head_dims`` (inclusive; None: unbounded), and on what evidence.

    Args:
        op (str): An op's name (:data:`visattn_mm.ops.specs.OPS`).
        dtype (str): 'bf16', 'fp16' or 'fp32' (the query's dtype; under autocast, the autocast dtype).
        decided (str): 'fast' or 'triton', as the rule (:func:`decide`) decided from ``measured``; 'auto'
            runs it while the op's kernels are the ones measured (:attr:`path`).
        measured (Measurement, optional): The evidence; None for a row no GPU has measured.
        head_dims (tuple): ``(smallest, largest)`` head dim the row covers. Default: all.
    """

    op: str
    dtype: str
    decided: str
    measured: Measurement | None = None
    head_dims: tuple = (None, None)

    @property
    def name(self):
        """How logs refer to the row, e.g. ``'sliding_chunk/bf16'`` (with the head dims where bounded)."""
        low, high = self.head_dims
        dims = '' if (low, high) == (None, None) else f'/d{low or 1}-{high or ""}'
        return f'{self.op}/{self.dtype}{dims}'

    @property
    def kernels_changed(self):
        """Whether the op's kernels compile to other code than those the row's GPU session measured (or the
        session recorded no digest of them)."""
        if self.measured is None:
            return False
        recorded = self.measured.kernel_digest
        return recorded is None or recorded != kernel_digests.KERNEL_DIGESTS.get(self.op)

    @property
    def path(self):
        """What 'auto' runs: :attr:`decided`, or 'fast' where the kernels changed since they were measured."""
        return 'fast' if self.kernels_changed else self.decided

    @property
    def reason(self):
        """Why the row says what it says, in a few words."""
        if self.measured is None:
            return UNMEASURED
        m = self.measured
        tests = TEST_OUTCOMES[m.tests]
        evidence = (
            f'{tests}; {m.model} triton/fast time {m.ratio_batch8:.2f} at batch 8, {m.ratio_batch2:.2f} at batch 2 '
            f'({m.device}, torch {m.torch}, triton {m.triton}, {m.commit}, {m.date})'
        )
        if not self.kernels_changed:
            return evidence
        measured_code = 'no digest of their code recorded' if m.kernel_digest is None else f'code {m.kernel_digest}'
        return (
            f'kernels changed since the GPU measured them at {m.commit} ({measured_code}, now '
            f'{kernel_digests.KERNEL_DIGESTS.get(self.op)}): run the CUDA tests and the decision rows on a GPU; '
            f'it measured: {evidence}'
        )

    def covers(self, op, dtype, head_dim):
        low, high = self.head_dims
        return (
            self.op == op
            and self.dtype == dtype
            and (head_dim is None or ((low is None or head_dim >= low) and (high is None or head_dim <= high)))
        )


def decide(measured):
    """The rule: 'triton' where the CUDA tests passed and it was faster than 'fast' at both batches.

    Args:
        measured (Measurement | None): A row's evidence.

    Returns:
        str: 'triton' or 'fast'.
    """
    if measured is None or measured.tests != 'passed':
        return 'fast'
    return 'triton' if measured.ratio_batch8 < 1 and measured.ratio_batch2 < 1 else 'fast'


def unmeasured_rows(measured=()):
    """An unmeasured 'fast' row for every op and dtype that the rows ``measured`` leave out."""
    return tuple(
        CudaDefault(op, dtype, 'fast')
        for op in OP_NAMES
        for dtype in DTYPE_NAMES.values()
        if not any(row.op == op and row.dtype == dtype for row in measured)
    )


# The rows the GPU sessions measured; docs/benchmarks.md ("What 'auto' runs on CUDA") has the measurements and the
# command that wrote them, results/ the device calls' files.
# BEGIN measured rows (tools/analysis/decide_cuda_defaults.py --write)
MEASURED_ON = dict(
    device='NVIDIA H200',
    torch='2.11.0+cu130',
    triton='3.6.0',
    commit='8403249,8f2db67,12c2ad5',
    date='2026-11-27',
)
MEASURED_ROWS = (  # op, dtype, path, deciding model, triton / fast time at batch 8 and 2, CUDA tests, kernel digest
    ('sliding_chunk', 'bf16', 'triton', 'vil-s', 0.429, 0.735, 'passed', '575622ee435d'),
    ('sliding_chunk', 'fp16', 'triton', 'vil-s', 0.418, 0.834, 'passed', '575622ee435d'),
    ('sliding_chunk', 'fp32', 'fast', 'vil-s', 1.113, 1.071, 'passed', '575622ee435d'),
    ('long_short', 'bf16', 'triton', 'vil-ls-s', 0.502, 0.927, 'passed', 'acb9efcbbf8b'),
    ('long_short', 'fp16', 'fast', 'vil-ls-s', 0.565, 0.969, 'incomplete', 'acb9efcbbf8b'),
    ('long_short', 'fp32', 'fast', 'vil-ls-s', 1.22, 1.161, 'passed', 'acb9efcbbf8b'),
    ('pale', 'bf16', 'fast', 'pale-t', 0.951, 1.041, 'passed', 'f1a6b7f8df7c'),
    ('pale', 'fp16', 'fast', 'pale-t', 0.988, 1.035, 'incomplete', 'f1a6b7f8df7c'),
    ('pale', 'fp32', 'fast', 'pale-t', 1.879, 1.492, 'passed', 'f1a6b7f8df7c'),
    ('vicinity', 'bf16', 'triton', 'vvt-s', 0.873, 0.581, 'passed', 'd0210ce311bb'),
    ('vicinity', 'fp16', 'fast', 'vvt-s', 0.874, 0.882, 'incomplete', 'd0210ce311bb'),
    ('vicinity', 'fp32', 'triton', 'vvt-s', 0.957, 0.936, 'passed', 'd0210ce311bb'),
)
# END measured rows
MEASURED = tuple(
    CudaDefault(
        op,
        dtype,
        path,
        Measurement(
            **MEASURED_ON,
            model=model,
            ratio_batch8=ratio8,
            ratio_batch2=ratio2,
            tests=tests,
            kernel_digest=kernel_digest,
        ),
    )
    for op, dtype, path, model, ratio8, ratio2, tests, kernel_digest in MEASURED_ROWS
)

#: The table: the measured rows first, then 'fast' for every op and dtype they leave out.
CUDA_DEFAULTS = MEASURED + unmeasured_rows(MEASURED)


def cuda_default(op, dtype, head_dim=None):
    """The row deciding 'auto' on CUDA for ``op`` on ``dtype`` queries of ``head_dim``.

    Args:
        op (str): The op's name.
        dtype (torch.dtype | str | None): The query's dtype (None: the op's bf16 row).
        head_dim (int, optional): The query's head dim (None: any row of the dtype).

    Returns:
        CudaDefault | None: None where no row covers the case ('auto' then runs 'fast').
    """
    name = 'bf16' if dtype is None else DTYPE_NAMES.get(dtype, dtype)
    return next((row for row in CUDA_DEFAULTS if row.covers(op, name, head_dim)), None)


def describe_cuda_defaults(op, evidence=True):
    """What 'auto' runs for ``op`` on CUDA, per dtype, and why: e.g. ``'pale fast on bf16, fp16, fp32
    (defaults table: not measured on a GPU yet)'``, rows of equal path and reason merged.

    Args:
        op (str): An op's name (an op without softmax, vicinity attention, names its 'fast' path 'torch ops').
        evidence (bool): Whether to give each row's reason (the measurement behind it); without,
            rows of equal path are merged and the line stays short (``'pale fast on bf16, fp16, fp32'``).
    """
    groups = {}
    for row in CUDA_DEFAULTS:
        if row.op == op:
            key = (row.path, row.reason) if evidence else (row.path, None)
            groups.setdefault(key, []).append(row.name.split('/', 1)[1])
    fast_label = 'fast' if op_spec(op).softmax else 'torch ops'
    return f'{op} ' + '; '.join(
        f'{fast_label if path == "fast" else path} on {", ".join(labels)}'
        + (f' (defaults table: {reason})' if evidence else '')
        for (path, reason), labels in groups.items()
    )
