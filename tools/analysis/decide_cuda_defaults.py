"""The CUDA defaults table from a GPU session: rows for ``visattn_mm/ops/cuda_defaults.py`` and the GPU
table of docs/benchmarks.md.

Reads what device calls of ``tools/gpu_session.sh`` bring back (``SESSION ...``: their ``$OUT`` folders,
in the order they ran): ``decide.csv`` and ``benchmark.csv`` (the decide and bench stages; a later call's row
replaces an earlier one's; a call whose files came back packed: unpack its ``results.tar.gz`` there first),
``tests.xml`` (the CUDA-marked tests; a later call's outcome of a test replaces an earlier one's: a later
call runs the code fixed after the earlier, and a failure stands until a later call passes that test) and
``session.log`` (the GPU and the versions, from the first call that reported them, and the digest of each op's
compiled kernels that every call reporting one reported: ``visattn_mm.env_report.KERNEL_DIGESTS_KEY``). For each op of
``visattn_mm.ops.specs.OP_SPECS`` and each dtype it takes

* the ``triton / fast`` time ratio of the op's deciding model (``OpSpec.deciding_model``), forward + backward
  at 800x1333, at batch 8 and at batch 2;
* whether the op's CUDA tests of that dtype passed: its kernels' file (at least one passed, none
  failed), and the backbone tests on ``'triton'`` of every backbone that runs the op (for each such
  backbone, at least one passed and none failed);

and applies the rule (``cuda_defaults.decide``). A dtype missing either batch stays unmeasured. Each row records
its op's kernel digest; where no call reported one, or calls reported different ones, it records None, which
'auto' does not trust (the row runs 'fast' until a session on one tree measures it).

Prints the measured rows as Python (``--write`` puts them into the package's table) and a markdown
table: per model, path and batch, time and peak memory x Swin-T, with the step-cost tracer's
predicted peak (``visattn_mm.analysis.step_cost``, CUDA emulated on the CPU) beside the measured
one (``--no-predict`` leaves the tracing out).

Example (after two device calls whose files came back to DIR1 and DIR2, kept in ``results/``)::

    .venv/bin/python tools/analysis/decide_cuda_defaults.py DIR1 DIR2 --commit 3cb5f65 --date 2026-11-26 --write
"""

from __future__ import annotations

import argparse
import os.path as osp
import re
import xml.etree.ElementTree as ElementTree

from visattn_mm.analysis import benchmarking
from visattn_mm.env_report import KERNEL_DIGESTS_KEY
from visattn_mm.models import BACKBONES
from visattn_mm.ops import cuda_defaults
from visattn_mm.ops.cuda_defaults import CudaDefault, Measurement, decide
from visattn_mm.ops.specs import OP_NAMES, OP_SPECS

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
TABLE_FILE = osp.join(ROOT, 'visattn_mm', 'ops', 'cuda_defaults.py')
#: Where the device calls' files are kept, one folder per call (``gpu_DATE/callN``; results/README.md).
RESULTS_DIR = osp.join(ROOT, 'results')
#: The device calls whose files decided the table's measured rows, in the order they ran (folders of
#: :data:`RESULTS_DIR`): a ``--write`` from other calls lists those here (a test runs the tool on these).
DECIDING_CALLS = ('gpu_2026-11-26/call3', 'gpu_2026-11-26/call5', 'gpu_2026-11-27/call1', 'gpu_2026-11-27/call2')
#: The kernel digests of the code those calls measured (``--kernel-digests``): they predate the report's digest
#: entry. The rows' timings in 16 bits are 2026-11-27's, on 12c2ad5's kernels, whose compiled code aa94e12 found
#: identical, launch by launch, to its own (``triton_resources.py --ptx``), as every kernel commit since checks;
#: the fp32 rows' are 2026-11-26's, on 8403249, whose fp32 launches 8f2db67 (4 warps in 16 bits) left as they were.
#: Restated when the digest stopped counting the debug labels of inlined helpers (``triton_resources.code_digest``):
#: the source whose old digests were 79d2c7e93b5d, 19db64f87f2a, 7125c02cba21 and 9d5234ea28eb (the calls' code,
#: by the chain above) digests to these under the new rule.
DECIDING_CALLS_DIGESTS = dict(
    sliding_chunk='575622ee435d', long_short='acb9efcbbf8b', pale='f1a6b7f8df7c', vicinity='d0210ce311bb'
)
BEGIN, END = '# BEGIN measured rows', '# END measured rows'
ROW_FIELDS = 'op, dtype, path, deciding model, triton / fast time at batch 8 and 2, CUDA tests, kernel digest'
SIZE = (800, 1333)
BATCHES = (8, 2)
# The sliding-chunk kernels' test module was test_triton_kernels in the sessions on record.
FORMER_KERNEL_TESTS = dict(sliding_chunk=('test_triton_kernels',))


def kernel_test_modules(op):
    """The test modules of the kernels of ``op``: its own, then the names it had in earlier sessions."""
    return (f'test_triton_{op}', *FORMER_KERNEL_TESTS.get(op, ()))


BACKBONE_TEST = 'test_backbone_matches_float64_reference'


def read_benchmark(sessions):
    """``{(model, impl, dtype, batch): row}`` of the forward + backward rows at :data:`SIZE` that ran, over
    ``sessions`` in order (a later row replaces an earlier one)."""
    found = {}
    for path in (osp.join(session, name) for session in sessions for name in ('decide.csv', 'benchmark.csv')):
        if not osp.exists(path):
            continue
        rows = benchmarking.read_csv(path)
        found.update(
            ((row['model'], row['impl'], row['dtype'], int(row['batch'])), row)
            for row in rows
            if row['mode'] == 'fwd+bwd' and (int(row['height']), int(row['width'])) == SIZE and row['status'] == 'ok'
        )
    return found


def read_tests(path):
    """``[(test id, outcome)]`` of a JUnit file: id ``module::name[params]``, outcome passed / failed / skipped."""
    outcomes = []
    for case in ElementTree.parse(path).getroot().iter('testcase'):
        module = case.get('classname', '').rsplit('.', 1)[-1]
        if case.find('failure') is not None or case.find('error') is not None:
            outcome = 'failed'
        elif case.find('skipped') is not None:
            outcome = 'skipped'
        else:
            outcome = 'passed'
        outcomes.append((f"{module}::{case.get('name')}", outcome))
    return outcomes


def read_logs(sessions):
    """The ``session.log`` text of each of ``sessions`` (the device calls' folders), in order."""
    return [open(osp.join(session, 'session.log')).read() for session in sessions]


def read_versions(logs):
    """The GPU, torch and Triton, from the first of the calls' ``logs`` (:func:`read_logs`) with the environment
    report."""
    text = next((log for log in logs if re.search(r'^GPU 0: ', log, re.M)), '')

    def first(pattern):
        found = re.search(pattern, text, re.M)
        return found.group(1).strip() if found else 'unknown'

    return dict(
        device=first(r'^GPU 0: (.+?), compute capability'),
        torch=first(r'^PyTorch: (\S+)'),
        triton=first(r'^Triton: (\S+)'),
    )


def read_kernel_digests(logs, given=None):
    """Each op's digest of its compiled kernels over the calls' ``logs`` that report them.

    Args:
        logs (list[str]): The calls' ``session.log`` texts (:func:`read_logs`).
        given (dict, optional): ``{op: digest}`` for calls that predate the report's entry (``--kernel-digests``);
            a call's own report that differs from it leaves the op without a digest.

    Returns:
        tuple: ``{op: digest or None}`` for every op (None where no call reported one or calls reported
        different ones), and a line for each op recorded as None.
    """
    reported = {op: {given[op]} if op in (given or {}) else set() for op in OP_NAMES}
    for log in logs:
        for line in re.findall(rf'^{re.escape(KERNEL_DIGESTS_KEY)}: (.*)$', log, re.M):
            for op, digest in re.findall(r'(\w+)=([0-9a-f]+)', line):
                if op in reported:
                    reported[op].add(digest)
    digests, gaps = {}, []
    for op, found in reported.items():
        if len(found) == 1:
            (digests[op],) = found
            continue
        digests[op] = None
        why = f'calls ran different kernels ({", ".join(sorted(found))})' if found else 'no call reported it'
        gaps.append(f"{op}: no kernel digest ({why}): its rows record None, and 'auto' runs 'fast' for them")
    return digests, gaps


def op_tests_outcome(op, dtype, outcomes):
    """How the CUDA tests of ``op`` in ``dtype`` went (``Measurement.tests``), over its kernel tests and the
    backbone tests on 'triton' of each backbone that runs it: 'failed' where one failed, else 'passed' where
    each group had one that passed, else 'incomplete'."""
    classes = [name for name, cls in BACKBONES.items() if any(spec.name == op for spec in cls.attention_ops)]
    kernel_tests = kernel_test_modules(op)

    def group(test_id):
        module, name = test_id.split('::', 1)
        params = re.split(r'[-\[\]]', name)
        if module in kernel_tests:
            return 'kernels' if dtype in params else None
        if name.startswith(BACKBONE_TEST) and 'triton' in params and dtype in params and params[2] in classes:
            return params[2]
        return None

    groups = {name: [] for name in ('kernels', *classes)}
    for test_id, outcome in outcomes:
        name = group(test_id)
        if name:
            groups[name].append(outcome)
    if any('failed' in found for found in groups.values()):
        return 'failed'
    return 'passed' if all('passed' in found for found in groups.values()) else 'incomplete'


def measured_rows(sessions, commit, date, kernel_digests=None):
    """The table rows the files of ``sessions`` decide, and a line for each op and dtype they leave unmeasured
    (``kernel_digests``: as :func:`read_kernel_digests` takes them)."""
    bench = read_benchmark(sessions)
    tests = [osp.join(session, 'tests.xml') for session in sessions]
    latest = {test_id: outcome for path in tests if osp.exists(path) for test_id, outcome in read_tests(path)}
    outcomes = list(latest.items())
    logs = read_logs(sessions)
    versions = read_versions(logs)
    digests, gaps = read_kernel_digests(logs, kernel_digests)
    rows = []
    for spec in OP_SPECS:
        op, model = spec.name, spec.deciding_model
        for dtype in cuda_defaults.DTYPE_NAMES.values():
            ratios = []
            for batch in BATCHES:
                fast, triton = (bench.get((model, impl, dtype, batch)) for impl in ('fast', 'triton'))
                if fast and triton:
                    ratios.append(float(triton['time_ms']) / float(fast['time_ms']))
            if len(ratios) < len(BATCHES):
                gaps.append(f'{op}/{dtype}: {model} lacks fast and triton rows at batch 8 and 2: stays unmeasured')
                continue
            measurement = Measurement(
                **versions,
                commit=commit,
                date=date,
                model=model,
                ratio_batch8=round(ratios[0], 3),
                ratio_batch2=round(ratios[1], 3),
                tests=op_tests_outcome(op, dtype, outcomes),
                kernel_digest=digests[op],
            )
            rows.append(CudaDefault(op, dtype, decide(measurement), measurement))
    return rows, gaps


def rows_source(rows):
    """The rows as the Python that stands between the markers of the table file: what all rows were
    measured on (one invocation's versions, commit and date), then one line per row."""
    begin = BEGIN + ' (tools/analysis/decide_cuda_defaults.py --write)'
    if not rows:
        return '\n'.join([begin, 'MEASURED_ON = dict()', f'MEASURED_ROWS = ()  # {ROW_FIELDS}', END])
    measured_on = {key: getattr(rows[0].measured, key) for key in ('device', 'torch', 'triton', 'commit', 'date')}
    lines = [begin, 'MEASURED_ON = dict(']
    lines += [f'    {key}={value!r},' for key, value in measured_on.items()]
    lines += [')', f'MEASURED_ROWS = (  # {ROW_FIELDS}']
    for row in rows:
        m = row.measured
        assert all(getattr(m, key) == value for key, value in measured_on.items()), 'one invocation, one origin'
        fields = (row.op, row.dtype, row.decided, m.model, m.ratio_batch8, m.ratio_batch2, m.tests, m.kernel_digest)
        lines.append(f'    ({", ".join(map(repr, fields))}),')
    lines += [')', END]
    return '\n'.join(lines)


def write_rows(rows, path=TABLE_FILE):
    """Replaces the measured rows between the markers of the table file with ``rows``."""
    text = open(path).read()
    begin, end = text.index(BEGIN), text.index(END) + len(END)
    with open(path, 'w') as file:
        file.write(text[:begin] + rows_source(rows) + text[end:])


def predicted_peak_gib(model, impl, batch):
    """The step-cost tracer's peak for a bf16 forward + backward at :data:`SIZE` (CUDA emulated)."""
    from visattn_mm.analysis.benchmark_backbones import build_backbone
    from visattn_mm.analysis.step_cost import trace_step
    from visattn_mm.ops.impl import attention_impl

    backbone = build_backbone(model)
    backbone.train()  # not chained: mmdet's ResNet.train returns None
    with attention_impl('auto' if impl == benchmarking.NO_IMPL else impl):
        cost = trace_step(backbone, (batch, 3, *SIZE), dtype='bf16')
    return cost.peak_bytes / benchmarking.GIB


def gpu_table(sessions, predict=True):
    """Markdown: the bf16 rows of each model, path and batch, x Swin-T, measured and predicted peak."""
    bench = read_benchmark(sessions)
    lines = [
        '| model | path | batch | time (ms) | x Swin-T | peak (MiB) | x Swin-T | tracer peak (MiB) '
        '| tracer / measured |',
        '|---|---|---|---|---|---|---|---|---|',
    ]
    for (model, impl, dtype, batch), row in sorted(bench.items(), key=lambda item: (item[0][3] != 8, item[0][3])):
        if dtype != 'bf16':
            continue
        measured = float(row['peak_mem_mib'])
        predicted = predicted_peak_gib(model, impl, batch) * 1024 if predict else None
        ratio = f'{predicted / measured:.3f}' if predicted else ''
        lines.append(
            f"| {model} | {impl} | {batch} | {float(row['time_ms']):.1f} | {row['time_ms_vs_swin-t']} | "
            f"{measured:.0f} | {row['peak_mem_mib_vs_swin-t']} | {f'{predicted:.0f}' if predicted else ''} | {ratio} |"
        )
    return '\n'.join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument(
        'sessions', nargs='+', help="the folders of device calls' files (benchmark.csv, tests.xml, session.log)"
    )
    parser.add_argument('--commit', required=True, help='the commit the device call ran')
    parser.add_argument('--date', required=True, help='the day it ran, YYYY-MM-DD')
    parser.add_argument('--write', action='store_true', help='put the measured rows into ' + TABLE_FILE)
    parser.add_argument('--no-predict', action='store_true', help="leave out the step-cost tracer's peaks")
    parser.add_argument(
        '--kernel-digests',
        help="OP=DIGEST,...: the digests of the kernels that calls predating the report's entry ran (the ones of "
        'DECIDING_CALLS: DECIDING_CALLS_DIGESTS)',
    )
    args = parser.parse_args(argv)
    if args.kernel_digests:
        pairs = [item.partition('=') for item in benchmarking.parse_list(args.kernel_digests, str, '--kernel-digests')]
        bad = [op for op, _, digest in pairs if op not in OP_NAMES or not digest]
        if bad:
            parser.error(f'--kernel-digests: {bad} not OP=DIGEST with OP of {", ".join(OP_NAMES)}')
        args.kernel_digests = {op: digest for op, _, digest in pairs}
    return args


def main(argv=None):
    args = parse_args(argv)
    rows, gaps = measured_rows(args.sessions, args.commit, args.date, args.kernel_digests)
    print(rows_source(rows))
    for gap in gaps:
        print(f'# {gap}')
    print()
    print(gpu_table(args.sessions, predict=not args.no_predict))
    if args.write:
        write_rows(rows)
        print(f'\nwrote {len(rows)} measured rows into {TABLE_FILE}')
    return rows


if __name__ == '__main__':
    main()
