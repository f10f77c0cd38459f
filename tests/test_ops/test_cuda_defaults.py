"""The CUDA defaults table (``visattn_mm.ops.cuda_defaults``): its form and rule, 'auto' following it
on CUDA (dispatch emulated on the CPU, as the step-cost tracer does) while the kernels compile to the code
a GPU measured, the reports that name its rows, and ``tools/analysis/decide_cuda_defaults.py`` turning a GPU
session's files into rows."""

from __future__ import annotations

import dataclasses
import importlib.util
import os.path as osp
import shutil
import sys
import warnings

import pytest
import torch

import visattn_mm.ops.cuda_defaults as cuda_defaults
from paths import ROOT
from tool_runs import _load_tool
from visattn_mm.analysis import benchmark_backbones
from visattn_mm.env_report import KERNEL_DIGESTS_KEY, attention_paths, format_env, plugin_env
from visattn_mm.models import BACKBONES, FAMILIES
from visattn_mm.ops import impl as impl_module
from visattn_mm.ops import kernel_digests
from visattn_mm.ops.cuda_defaults import UNMEASURED, CudaDefault, Measurement, decide
from visattn_mm.ops.impl import attention_impl, attention_path, chosen_path, dispatch_as
from visattn_mm.ops.specs import OP_NAMES, OP_SPECS

defaults_tool = _load_tool('analysis/decide_cuda_defaults')
DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}


def _measurement(ratio8, ratio2, tests='passed', op='sliding_chunk'):
    """Evidence for a row of ``op`` whose kernels compile to the code measured."""
    digest = kernel_digests.KERNEL_DIGESTS[op]
    return Measurement('GPU', '2.11.0', '3.6.0', 'abc1234', '2026-11-26', 'vil-s', ratio8, ratio2, tests, digest)


# --- the table ------------------------------------------------------------------------------


def test_every_op_with_kernels_has_one_row_per_dtype():
    for op in OP_NAMES:
        for dtype in DTYPES.values():
            rows = [row for row in cuda_defaults.CUDA_DEFAULTS if row.covers(op, cuda_defaults.DTYPE_NAMES[dtype], 32)]
            assert len(rows) >= 1, (op, dtype)
            assert cuda_defaults.cuda_default(op, dtype, 32) is rows[0]


def test_rows_follow_the_rule():
    for row in cuda_defaults.CUDA_DEFAULTS:
        assert row.decided in cuda_defaults.PATHS
        assert row.decided == decide(row.measured), row
        assert row.path == ('fast' if row.kernels_changed else row.decided), row
        if row.measured is None:
            assert row.path == 'fast' and row.reason == UNMEASURED and not row.kernels_changed


@pytest.mark.parametrize(
    'measured,path',
    [
        (None, 'fast'),
        (_measurement(0.7, 0.9), 'triton'),
        (_measurement(0.7, 1.0), 'fast'),  # not faster at batch 2
        (_measurement(1.1, 0.5), 'fast'),  # not faster at batch 8
        (_measurement(0.5, 0.5, tests='failed'), 'fast'),
        (_measurement(0.5, 0.5, tests='incomplete'), 'fast'),
    ],
)
def test_the_rule(measured, path):
    assert decide(measured) == path


def test_a_row_says_why():
    row = CudaDefault('pale', 'bf16', 'triton', _measurement(0.71, 0.83, op='pale'))
    assert row.name == 'pale/bf16'
    assert row.reason == (
        'CUDA tests passed; vil-s triton/fast time 0.71 at batch 8, 0.83 at batch 2 '
        '(GPU, torch 2.11.0, triton 3.6.0, abc1234, 2026-11-26)'
    )
    bounded = dataclasses.replace(row, head_dims=(33, None))
    assert (
        bounded.name == 'pale/bf16/d33-'
        and not bounded.covers('pale', 'bf16', 32)
        and bounded.covers('pale', 'bf16', 64)
    )


# --- 'auto' follows it ----------------------------------------------------------------------


@pytest.fixture
def triton_bf16_sliding_chunk(monkeypatch):
    """A table whose one measured row, sliding-chunk bf16 for head dims up to 32, says 'triton'."""
    row = CudaDefault('sliding_chunk', 'bf16', 'triton', _measurement(0.5, 0.8), head_dims=(None, 32))
    monkeypatch.setattr(cuda_defaults, 'CUDA_DEFAULTS', (row, *cuda_defaults.unmeasured_rows()))
    return row


def test_auto_on_cuda_follows_the_table(triton_bf16_sliding_chunk):
    def path(dtype, head_dim, impl='auto', op='sliding_chunk'):
        return chosen_path('cuda', True, impl, op=op, dtype=dtype, head_dim=head_dim)

    assert path(torch.bfloat16, 32) == 'triton'
    assert path(torch.bfloat16, 64) == 'fast'  # outside the row's head dims: the unmeasured row
    assert path(torch.float32, 32) == 'fast'
    assert path(torch.bfloat16, 32, op='long_short') == 'fast'
    assert path(torch.bfloat16, 32, impl='fast') == 'fast'  # an explicit value is what runs
    assert path(torch.bfloat16, 32, impl='math') == 'math'
    with attention_impl('fast'):  # a process-wide selection decides 'auto' instead of the table
        assert path(torch.bfloat16, 32) == 'fast'
    # The CPU's own rule is untouched.
    assert chosen_path('cpu', True, op='sliding_chunk', dtype=torch.bfloat16, head_dim=32) == 'math'


def test_auto_under_deterministic_algorithms_keeps_unmeasured_kernels_off(triton_bf16_sliding_chunk, monkeypatch):
    """Under torch.use_deterministic_algorithms the kernels sum a training bias's gradient in a kernel of
    their own, which no GPU row measured: 'auto' then runs 'fast' where a bias trains and says why once;
    a frozen bias, or 'triton' asked for, keeps the kernels."""
    monkeypatch.setattr(impl_module.STATE, 'warnings_given', set())
    monkeypatch.setattr(torch, 'are_deterministic_algorithms_enabled', lambda: True)

    def path(bias_needs_grad, impl='auto'):
        return chosen_path('cuda', bias_needs_grad, impl, op='sliding_chunk', dtype=torch.bfloat16, head_dim=32)

    with pytest.warns(UserWarning, match=r"runs sliding_chunk attention with torch ops \('fast'\).*deterministic"):
        assert path(True) == 'fast'
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # once
        assert path(True) == 'fast'
    assert path(False) == 'triton'
    assert path(True, impl='triton') == 'triton'


def test_an_op_call_on_emulated_cuda_takes_the_tables_path(triton_bf16_sliding_chunk, monkeypatch):
    """sliding_chunk_attention with 'auto', its tensors standing for CUDA ones: the Triton kernels are
    called for a bf16 query of head dim 32, the fused torch path for fp32."""
    import visattn_mm.ops.sliding_chunk.triton as triton_sliding_chunk
    from visattn_mm.ops.sliding_chunk import sliding_chunk_attention

    calls = []
    monkeypatch.setattr(
        triton_sliding_chunk, 'triton_sliding_chunk_attention', lambda q, *args, **kwargs: calls.append(q.dtype) or q
    )
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(1, 2, 16, 32, dtype=dtype) for _ in range(3))
        with dispatch_as('cuda'):
            assert attention_path('sliding_chunk', q, impl='auto') == ('triton' if dtype == torch.bfloat16 else 'fast')
            out = sliding_chunk_attention(q, k, v, 4, 4, 2)
        assert out.shape == q.shape
    assert calls == [torch.bfloat16]


@pytest.mark.parametrize(
    'op,head_dim,limits,reason',
    [
        ('sliding_chunk', 32, dict(dropout_p=0.1), r'attention dropout \(dropout_p=0.1\)'),
        ('long_short', 32, dict(window=12), 'windows of at most 11 tokens.*got window=12'),
        ('pale', 32, dict(dropout_p=0.2), r'attention dropout \(dropout_p=0.2\)'),
        ('vicinity', 96, {}, 'head dims up to 64, got 96'),
    ],
)
def test_auto_skips_triton_where_its_kernels_cannot_run_and_says_why(monkeypatch, op, head_dim, limits, reason):
    """Where the table says 'triton' but the call is one the kernels cannot run, 'auto' runs the fused torch
    path and warns once, naming the reason; 'triton' asked for raises, naming it and the fix."""
    row = CudaDefault(op, 'bf16', 'triton', _measurement(0.5, 0.8, op=op))
    monkeypatch.setattr(cuda_defaults, 'CUDA_DEFAULTS', (row, *cuda_defaults.unmeasured_rows()))
    monkeypatch.setattr(impl_module.STATE, 'warnings_given', set())
    q = torch.zeros(1, 2, 16, head_dim, dtype=torch.bfloat16)
    with dispatch_as('cuda'):
        assert attention_path(op, q[..., :32], impl='auto') == 'triton'  # within the limits
        with pytest.warns(UserWarning, match=f"'auto' runs {op} attention with torch ops here.*{reason}"):
            assert attention_path(op, q, impl='auto', **limits) == 'fast'
        with warnings.catch_warnings():
            warnings.simplefilter('error')  # once per reason
            assert attention_path(op, q, impl='auto', **limits) == 'fast'
        with pytest.raises(ValueError, match=f"impl 'triton' cannot run this {op} attention call: .*{reason}.*impl '"):
            attention_path(op, q, impl='triton', **limits)


def _auto_on_cuda(op, dtype):
    """The path of an op call with 'auto' on (emulated) CUDA tensors of ``dtype``, head dim 32."""
    with dispatch_as('cuda'):
        return attention_path(op, torch.zeros(1, 2, 16, 32, dtype=DTYPES[dtype]), impl='auto')


def test_auto_does_not_trust_kernels_changed_since_the_gpu_measured_them(monkeypatch):
    """The table's 'triton' rows run 'triton' while each op's kernels compile to the code its GPU session
    measured; once the sliding-chunk kernels compile to other code, their rows run 'fast' and say why (the
    environment report too), the other ops' rows keep 'triton'; a row that recorded no digest runs 'fast'."""
    triton_rows = [row for row in cuda_defaults.CUDA_DEFAULTS if row.decided == 'triton']
    assert 'sliding_chunk' in {row.op for row in triton_rows} and len({row.op for row in triton_rows}) >= 2
    measured = {row.op: row.measured.kernel_digest for row in triton_rows}
    monkeypatch.setattr(kernel_digests, 'KERNEL_DIGESTS', dict(kernel_digests.KERNEL_DIGESTS, **measured))
    assert all(_auto_on_cuda(row.op, row.dtype) == 'triton' for row in triton_rows)

    monkeypatch.setattr(
        kernel_digests, 'KERNEL_DIGESTS', dict(kernel_digests.KERNEL_DIGESTS, sliding_chunk='0123456789ab')
    )
    for row in triton_rows:
        assert _auto_on_cuda(row.op, row.dtype) == ('fast' if row.op == 'sliding_chunk' else 'triton'), row.name
    row = cuda_defaults.cuda_default('sliding_chunk', torch.bfloat16, 32)
    assert (row.decided, row.path, row.kernels_changed) == ('triton', 'fast', True)
    assert row.reason.startswith(
        f'kernels changed since the GPU measured them at {row.measured.commit} (code {measured["sliding_chunk"]}, '
        'now 0123456789ab): run the CUDA tests and the decision rows on a GPU; it measured: CUDA tests passed; vil-s'
    )
    assert f'sliding_chunk fast on bf16 (defaults table: {row.reason})' in attention_paths('cuda')['ViL']

    unrecorded = CudaDefault('pale', 'bf16', 'triton', dataclasses.replace(_measurement(0.5, 0.8), kernel_digest=None))
    assert unrecorded.path == 'fast' and 'no digest of their code recorded' in unrecorded.reason


def test_environment_report_and_build_log_name_the_rows(triton_bf16_sliding_chunk, monkeypatch):
    import visattn_mm.models as models
    import visattn_mm.models.layers as layers

    paths = attention_paths('cuda')
    assert paths['ViL'] == (
        'sliding_chunk triton on bf16/d1-32 (defaults table: ' + triton_bf16_sliding_chunk.reason + '); '
        f'fast on bf16, fp16, fp32 (defaults table: {UNMEASURED})'
    )
    assert paths['VVT'] == f'vicinity torch ops on bf16, fp16, fp32 (defaults table: {UNMEASURED})'
    assert attention_paths('cpu')['VVT'] == 'vicinity torch ops'  # the CPU report as before
    lines = []
    monkeypatch.setattr(layers, 'print_log', lambda msg, logger=None: lines.append(msg))
    models.PaleTransformer(arch='tiny')
    assert lines == [
        f"PaleTransformer: attn_impl='auto': {impl_module.SOFTMAX_SUMMARIES['auto']}; on CUDA: "
        'pale fast on bf16, fp16, fp32 (why: python tools/collect_env.py on the GPU machine)'
    ]
    # The evidence stays in the environment report: a row with a measurement (ViL's triton row) is named
    # by path and dtypes only.
    lines.clear()
    models.ViL(arch='tiny')
    assert lines[0].endswith(
        '; on CUDA: sliding_chunk triton on bf16/d1-32; fast on bf16, fp16, fp32 '
        '(why: python tools/collect_env.py on the GPU machine)'
    )
    assert triton_bf16_sliding_chunk.reason not in lines[0]


# --- the tool -------------------------------------------------------------------------------

BENCH_HEADER = (
    'model,impl,mode,dtype,batch,height,width,time_ms,peak_mem_mib,time_ms_vs_swin-t,peak_mem_mib_vs_swin-t,status'
)


#: The kernel digests of the sessions below: ``op=digest`` as the environment report writes them.
SESSION_DIGESTS = {op: letter * 12 for op, letter in zip(OP_NAMES, 'abcd')}


def _digests_line(monkeypatch, digests):
    """The environment report's line of kernel digests, for a tree whose kernels compile to ``digests``."""
    with monkeypatch.context() as patched:
        patched.setattr(kernel_digests, 'KERNEL_DIGESTS', digests)
        return format_env({KERNEL_DIGESTS_KEY: plugin_env('cpu')[KERNEL_DIGESTS_KEY]})


def _session(folder, times, failing=(), failing_backbone=None, backbones=tuple(BACKBONES), digests_line=''):
    """A device call's files: benchmark rows of ``times`` ({(model, impl, batch): ms}, bf16, fwd+bwd,
    800x1333), tests.xml with one passing kernel test per op and dtype (``failing``: (module, dtype)
    that fail instead) and a passing bf16 backbone test on 'triton' for each of ``backbones``
    (``failing_backbone``: the class whose one fails), and the environment report's lines (with
    ``digests_line``, :func:`_digests_line`, where the call reported its kernels)."""
    folder.mkdir(exist_ok=True)
    lines = [BENCH_HEADER]
    for batch in (8, 2):
        lines.append(f'swin-t,-,fwd+bwd,bf16,{batch},800,1333,100,1000,1,1,ok')
    for (model, impl, batch), ms in times.items():
        lines.append(f'{model},{impl},fwd+bwd,bf16,{batch},800,1333,{ms},2000,{ms / 100},2,ok')
    lines.append('vil-s,triton,fwd,bf16,8,800,1333,1,1,0.01,0.001,ok')  # forward alone never decides
    (folder / 'benchmark.csv').write_text('\n'.join(lines) + '\n')
    cases = []
    for module in (defaults_tool.kernel_test_modules(op)[0] for op in OP_NAMES):
        for dtype in ('fp32', 'bf16'):
            failure = '<failure message="x"/>' if (module, dtype) in failing else ''
            cases.append(
                f'<testcase classname="tests.test_ops.test_triton.{module}" '
                f'name="test_cuda_kernels_match_float64_math[{dtype}-0-0]">'
                f'{failure}</testcase>'
            )
    for name in backbones:
        failure = '<failure message="y"/>' if name == failing_backbone else ''
        cases.append(
            '<testcase classname="tests.test_cuda" name="test_backbone_matches_float64_reference'
            f'[cuda-{name}-triton-bf16-64x64]">{failure}</testcase>'
        )
    (folder / 'tests.xml').write_text(f'<testsuites><testsuite>{"".join(cases)}</testsuite></testsuites>')
    (folder / 'session.log').write_text(
        f'GPU 0: NVIDIA H100 80GB HBM3, compute capability 9.0\nPyTorch: 2.11.0+cu130\nTriton: 3.6.0\n{digests_line}\n'
    )
    return folder


def test_tool_decides_rows_from_a_sessions_files(tmp_path, monkeypatch):
    times = {
        ('vil-s', 'fast', 8): 200,
        ('vil-s', 'triton', 8): 150,
        ('vil-s', 'fast', 2): 60,
        ('vil-s', 'triton', 2): 50,  # faster at both: triton
        ('vil-ls-s', 'fast', 8): 200,
        ('vil-ls-s', 'triton', 8): 150,
        ('vil-ls-s', 'fast', 2): 60,
        ('vil-ls-s', 'triton', 2): 50,  # faster, but a bf16 test of its kernels failed
        ('pale-t', 'fast', 8): 200,
        ('pale-t', 'triton', 8): 150,
        ('pale-t', 'fast', 2): 60,
        ('pale-t', 'triton', 2): 70,  # slower at batch 2
        ('vvt-s', 'fast', 8): 200,
        ('vvt-s', 'triton', 8): 100,  # batch 2 missing: unmeasured
    }
    reported = _digests_line(monkeypatch, SESSION_DIGESTS)
    session = _session(tmp_path / 'session', times, failing=[('test_triton_long_short', 'bf16')], digests_line=reported)
    table = tmp_path / 'cuda_defaults.py'
    shutil.copy(defaults_tool.TABLE_FILE, table)
    rows, gaps = defaults_tool.measured_rows([str(session)], 'abc1234', '2026-11-26')
    # The rule's decisions ('auto' runs them where this tree's kernels are the session's: below).
    decided = {(row.op, row.dtype): (row.decided, row.measured.ratio_batch8, row.measured.ratio_batch2) for row in rows}
    assert decided == {
        ('sliding_chunk', 'bf16'): ('triton', 0.75, 0.833),
        ('long_short', 'bf16'): ('fast', 0.75, 0.833),
        ('pale', 'bf16'): ('fast', 0.75, 1.167),
    }
    long_short = next(row for row in rows if row.op == 'long_short')
    assert long_short.measured.tests == 'failed' and rows[0].measured.tests == 'passed'
    # No kernel test in a dtype: the row's tests are incomplete, not failed, and its reason says so.
    outcomes = defaults_tool.read_tests(session / 'tests.xml')
    assert defaults_tool.op_tests_outcome('pale', 'fp16', outcomes) == 'incomplete'
    assert 'CUDA tests incomplete' in CudaDefault('pale', 'fp16', 'fast', _measurement(0.9, 0.9, 'incomplete')).reason
    assert rows[0].measured.device == 'NVIDIA H100 80GB HBM3' and rows[0].measured.triton == '3.6.0'
    assert 'vicinity/bf16: vvt-s lacks fast and triton rows at batch 8 and 2: stays unmeasured' in gaps
    # Each row records the digest of its op's kernels that the call reported.
    assert {row.op: row.measured.kernel_digest for row in rows} == {
        op: SESSION_DIGESTS[op] for op in OP_NAMES if op != 'vicinity'
    }
    # A failed backbone test on 'triton' counts against every op the backbone runs.
    later = _session(tmp_path / 'later', times, failing_backbone='ViLLS')
    paths = {(row.op, row.dtype): row.decided for row in defaults_tool.measured_rows([str(later)], 'c', 'd')[0]}
    assert paths['sliding_chunk', 'bf16'] == paths['long_short', 'bf16'] == 'fast'
    # Over two calls a test's later outcome counts: a failure stands until a later call passes the test.
    both = defaults_tool.measured_rows([str(session), str(later)], 'c', 'd')[0]
    assert {(row.op, row.dtype): row.decided for row in both} == paths
    fixed = _session(tmp_path / 'fixed', times)
    after_fix = defaults_tool.measured_rows([str(later), str(fixed)], 'c', 'd')[0]
    assert {(row.op, row.dtype): row.decided for row in after_fix}['long_short', 'bf16'] == 'triton'
    before_fix = defaults_tool.measured_rows([str(fixed), str(later)], 'c', 'd')[0]
    assert {(row.op, row.dtype): row.decided for row in before_fix}['long_short', 'bf16'] == 'fast'
    # Kernel tests alone are not enough: each backbone that runs the op needs a passing test of its own.
    without_vil = _session(tmp_path / 'without-vil', times, backbones=('ViLLS', 'PaleTransformer', 'VVT'))
    rows_without = defaults_tool.measured_rows([str(without_vil)], 'c', 'd')[0]
    assert {(row.op, row.dtype): row.decided for row in rows_without}['sliding_chunk', 'bf16'] == 'fast'
    # Digests: a call that did not report them (a tests-only call) adds nothing; calls that reported different
    # kernels of an op, or none at all, leave its rows without one, which 'auto' does not trust.
    quiet = _session(tmp_path / 'quiet', times)
    assert defaults_tool.read_kernel_digests(defaults_tool.read_logs([session, quiet])) == (SESSION_DIGESTS, [])
    rebuilt = _digests_line(monkeypatch, dict(SESSION_DIGESTS, long_short='e' * 12))
    other = _session(tmp_path / 'other', times, digests_line=rebuilt)
    digests, digest_gaps = defaults_tool.read_kernel_digests(defaults_tool.read_logs([session, other]))
    assert digests == dict(SESSION_DIGESTS, long_short=None)
    assert digest_gaps == [
        f"long_short: no kernel digest (calls ran different kernels ({'b' * 12}, {'e' * 12})): its rows record None, "
        "and 'auto' runs 'fast' for them"
    ]
    unreported, quiet_gaps = defaults_tool.measured_rows([str(quiet)], 'c', 'd')
    assert {row.measured.kernel_digest for row in unreported} == {None} and {row.path for row in unreported} == {'fast'}
    assert (
        "sliding_chunk: no kernel digest (no call reported it): its rows record None, and 'auto' runs 'fast' for them"
    ) in quiet_gaps
    # --write: the rows land between the markers, and the module built from them holds them; 'auto' takes their
    # path while the kernels compile to the recorded code.
    defaults_tool.write_rows(rows, str(table))
    spec = importlib.util.spec_from_file_location('visattn_mm.ops.written_cuda_defaults', table)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    written = {(row.op, row.dtype): row for row in module.CUDA_DEFAULTS}
    assert written['sliding_chunk', 'bf16'].decided == 'triton'
    assert written['sliding_chunk', 'bf16'].path == 'fast'  # this tree's kernels are not the session's
    monkeypatch.setattr(kernel_digests, 'KERNEL_DIGESTS', SESSION_DIGESTS)
    assert written['sliding_chunk', 'bf16'].path == 'triton'
    assert dataclasses.asdict(written['sliding_chunk', 'bf16'].measured) == dataclasses.asdict(rows[0].measured)
    assert written['sliding_chunk', 'fp32'].measured is None and written['sliding_chunk', 'fp32'].path == 'fast'
    assert len(module.CUDA_DEFAULTS) == len(OP_NAMES) * len(DTYPES)
    # The GPU table: every bf16 fwd+bwd row, batch 8 first, with the ratios the benchmark wrote.
    markdown = defaults_tool.gpu_table([str(session)], predict=False).splitlines()
    assert markdown[0].startswith('| model | path | batch | time (ms) | x Swin-T |')
    assert len(markdown) == 2 + 2 + len(times)
    assert '| vil-s | triton | 8 | 150.0 | 1.5 | 2000 | 2 |  |  |' in markdown


def test_the_recorded_calls_give_the_tables_rows_and_the_gpu_table():
    """The device calls on record (``DECIDING_CALLS`` in ``results/``) give, through the tool, the table's measured
    rows as they stand and the bf16 rows of docs/benchmarks.md's H200 table: neither was written by hand, and
    moving or editing the calls' files breaks this."""
    calls = [osp.join(defaults_tool.RESULTS_DIR, call) for call in defaults_tool.DECIDING_CALLS]
    assert all(osp.isdir(call) for call in calls), calls
    measured_on = cuda_defaults.MEASURED_ON
    rows, _ = defaults_tool.measured_rows(
        calls, measured_on['commit'], measured_on['date'], defaults_tool.DECIDING_CALLS_DIGESTS
    )
    assert tuple(rows) == cuda_defaults.MEASURED
    # The recorded calls name no digest of their own: without the given ones no row is trusted.
    unknown, gaps = defaults_tool.measured_rows(calls, measured_on['commit'], measured_on['date'])
    assert {row.path for row in unknown} == {'fast'} and len(gaps) == len(OP_NAMES)
    # Today's kernels are the ones measured: 'auto' runs what the rule decided.
    assert all(row.path == row.decided for row in cuda_defaults.MEASURED)
    page = (ROOT / 'docs' / 'benchmarks.md').read_text()
    table = defaults_tool.gpu_table(calls, predict=False).splitlines()[2:]
    assert len(table) >= 2 * len(defaults_tool.BATCHES) * len(OP_NAMES)
    for line in table:
        measured = line.rsplit('|', 3)[0]  # the tracer's two columns left out
        assert measured in page, f'docs/benchmarks.md lacks the row {line}'


def test_tool_predicts_peaks_with_the_tracer(monkeypatch):
    """The tracer's peak for a row: a real trace, of a tiny backbone here (the command runs the rows' models)."""
    from visattn_mm.models import ViL

    monkeypatch.setattr(defaults_tool, 'SIZE', (64, 64))
    monkeypatch.setattr(benchmark_backbones, 'build_backbone', lambda name: ViL(arch='tiny'))
    peak = defaults_tool.predicted_peak_gib('vil-t', 'fast', 1)
    assert 0 < peak < 1


def test_each_op_is_decided_by_a_backbone_that_runs_it():
    """By the size of a family that runs the op which the tools set beside Swin-T."""
    compared = {family.compared_model: family for family in FAMILIES}
    for spec in OP_SPECS:
        model = spec.deciding_model
        assert model in benchmark_backbones.MODEL_ZOO and model in compared, model
        assert spec in compared[model].cls.attention_ops, (spec.name, model)
