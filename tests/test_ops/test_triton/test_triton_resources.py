"""The Triton kernels' launch settings and the tools that choose them.

tools/analysis/triton_resources.py compiles every Triton kernel of a backbone's training step for sm_90 (no
GPU) and reads the registers and spills ptxas reports: the launch settings keep them within bounds; each op's
digest of its compiled code is the committed one (visattn_mm/ops/kernel_digests.py), which the CUDA defaults
table's rows are checked against.
tools/analysis/triton_tuning.py times each kernel under candidate settings on a GPU; here its plumbing runs
in Triton's interpreter, in a subprocess (this file run as a script, see :mod:`triton_harness`).
"""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import build_tiny
from paths import ROOT
from tool_runs import _load_tool
from triton_harness import interpreted_fixture, main, skip_unless_compiled
from visattn_mm.models import ViL
from visattn_mm.ops import kernel_digests
from visattn_mm.ops.specs import OP_NAMES

triton_resources = _load_tool('analysis/triton_resources')
triton_tuning = _load_tool('analysis/triton_tuning')

# Spill stores (bytes per thread) the launch settings keep each kernel within, by input dtype. bf16 trains on
# tensor cores with few spills: the sliding-chunk query-side backward at head dim 64 spills about 150 bytes
# with 4 warps, which 16-bit launches keep because 8 warps were wrong there on Hopper
# (visattn_mm.ops.triton.host.launch_settings). fp32 products on CUDA cores hold more registers (the key-side
# backward kernels spilled up to 8 KB per thread before the settings were chosen).
MAX_SPILL = dict(bf16=192, fp32=2560)
KERNELS = {
    'vil-s': {'_sliding_chunk_forward', '_sliding_chunk_backward_queries', '_sliding_chunk_backward_keys'},
    'vil-ls-s': {
        '_long_short_forward',
        '_long_short_backward_queries',
        '_long_short_backward_keys',
        '_sliding_chunk_forward',
        '_sliding_chunk_backward_queries',
        '_sliding_chunk_backward_keys',
    },
    'pale-t': {'_pale_forward', '_pale_backward_queries', '_pale_backward_keys'},
    'vvt-s': {'_vicinity_sums', '_vicinity_forward', '_vicinity_backward_queries', '_vicinity_backward_keys'},
}
# VVT's opt-in fused conv-FFN (fused_conv_gelu=True), which no other model launches.
CONV_GELU_KERNELS = {'_conv_gelu_forward', '_conv_gelu_backward_pre', '_conv_gelu_backward_input'}
KERNELS['vvt-s-fused'] = KERNELS['vvt-s'] | CONV_GELU_KERNELS
CANDIDATE = dict(num_warps=2, num_stages=2)  # unlike any package setting
interpreted = interpreted_fixture()  # the tuning run below, in the interpreter


@pytest.fixture(scope='module')
def rows():
    skip_unless_compiled()
    return triton_resources.main([])


def test_every_kernel_of_every_backbone_is_compiled_and_reported(rows):
    for model, kernels in KERNELS.items():
        for dtype in MAX_SPILL:
            found = {row['kernel'] for row in rows if row['model'] == model and row['dtype'] == dtype}
            assert found == kernels, (model, dtype)
    assert all(0 < row['registers'] <= 255 for row in rows)
    # Every attention kernel stages tiles in shared memory; conv_gelu's elementwise ones need none.
    assert all(row['shared_kib'] > 0 for row in rows if row['op'] != 'conv_gelu')


def test_fused_conv_gelu_kernels_do_not_spill_and_have_no_digest(rows):
    """VVT's opt-in depthwise-conv+GELU kernels (``vvt-s-fused``) are reported in fp32 and bf16 without register
    spills, and left out of the op digests: no row of the CUDA defaults table is checked against their code."""
    fused = [row for row in rows if row['op'] == 'conv_gelu']
    assert {(row['kernel'], row['dtype']) for row in fused} == {(k, d) for k in CONV_GELU_KERNELS for d in MAX_SPILL}
    assert all(row['model'] == 'vvt-s-fused' and row['spill_stores'] == row['spill_loads'] == 0 for row in fused)
    assert 'conv_gelu' not in triton_resources.op_digests(rows)


def test_code_digest_ignores_debug_lines_only(rows):
    """The digest that tells whether a source change left the compiled code as it was: moved source lines
    (``.loc``), comments and the debug labels of an inlined helper's range (a helper split off) do not change
    it, an instruction does; every row has one."""
    ptx = '.version 8.7\n.file 1 "kernel.py"\n\tld.global.b32 %r1, [%rd1];\n\t.loc 1 10 5\n\tret;\n'
    moved = ptx.replace('.loc 1 10 5', '.loc 1 42 7').replace('.version 8.7', '// note\n.version 8.7')
    assert triton_resources.code_digest(moved) == triton_resources.code_digest(ptx)
    inlined = ptx.replace('\tld.global', '$L__tmp3:\n\tld.global').replace('\tret', '$L__tmp4:\n\tret')
    assert triton_resources.code_digest(inlined) == triton_resources.code_digest(ptx)
    assert triton_resources.code_digest(ptx.replace('\tret', '$L__BB0_2:\n\tret')) != triton_resources.code_digest(ptx)
    assert triton_resources.code_digest(ptx.replace('b32 %r1', 'b32 %r2')) != triton_resources.code_digest(ptx)
    assert all(len(row['ptx']) == 12 for row in rows)


def test_committed_kernel_digests_are_the_code_the_kernels_compile_to(rows):
    """'auto' trusts a defaults-table row only while its op's kernels compile to the code the row recorded, as
    visattn_mm/ops/kernel_digests.py says they do: a kernel change must regenerate that file (and so leaves
    the op's rows on 'fast' until a GPU measures the new code)."""
    import triton

    assert triton.__version__ == kernel_digests.TRITON, (
        f'kernel_digests.py holds the code of Triton {kernel_digests.TRITON}, this is {triton.__version__}: where the '
        f"lock file's torch brought this Triton, regenerate it ({triton_resources.DIGESTS_COMMAND}), else install the "
        'lock file (tools/bootstrap.sh)'
    )
    digests = triton_resources.op_digests(rows)
    assert list(digests) == list(OP_NAMES)
    changes = triton_resources.digest_changes(digests)
    assert not changes, f'visattn_mm/ops/kernel_digests.py is stale ({changes}): {triton_resources.DIGESTS_COMMAND}'


def test_op_digests_follow_each_launchs_code_however_rows_group_launches():
    row = dict(op='pale', launches=('a' * 12, 'b' * 12))
    split = [dict(op='pale', launches=('b' * 12,)), dict(op='pale', launches=('a' * 12, 'b' * 12))]
    assert triton_resources.op_digests([row]) == triton_resources.op_digests(split)
    assert triton_resources.op_digests([row]) != triton_resources.op_digests([dict(row, launches=('a' * 12,))])
    # An op without defaults-table rows is left out; one the spec table lacks is refused.
    fused = dict(op='conv_gelu', launches=('c' * 12,))
    assert triton_resources.op_digests([row, fused]) == triton_resources.op_digests([row])
    with pytest.raises(ValueError, match=r"kernels of \['swin'\], which the spec table \(visattn_mm.ops.specs\) lacks"):
        triton_resources.op_digests([dict(op='swin', launches=())])


def test_digests_are_written_as_the_package_reads_them(tmp_path, monkeypatch, capsys):
    import triton

    digests = {op: str(index) * 12 for index, op in enumerate(OP_NAMES)}
    path = tmp_path / 'kernel_digests.py'
    triton_resources.check_or_write_digests(digests, 'write', 90, path=str(path))
    spec = importlib.util.spec_from_file_location('written_kernel_digests', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (module.KERNEL_DIGESTS, module.TRITON, module.CAPABILITY) == (digests, triton.__version__, 90)
    # 'check' passes against the table it wrote, and fails naming the op and the command against another.
    monkeypatch.setattr(kernel_digests, 'KERNEL_DIGESTS', module.KERNEL_DIGESTS)
    monkeypatch.setattr(kernel_digests, 'TRITON', module.TRITON)
    triton_resources.check_or_write_digests(digests, 'check', 90)
    assert 'is current' in capsys.readouterr().out
    with pytest.raises(
        SystemExit, match=f"(?s)pale: the table says {'2' * 12}, its kernels compile to f+.*--digests write"
    ):
        triton_resources.check_or_write_digests(dict(digests, pale='f' * 12), 'check', 90)


def test_digests_cover_every_kernel_at_the_defaults():
    with pytest.raises(SystemExit):
        triton_resources.parse_args(['--digests', 'check', '--models', 'vil-s'])
    with pytest.raises(SystemExit):  # the kernels of deterministic mode are not 'auto''s
        triton_resources.parse_args(['--digests', 'check', '--deterministic'])
    assert triton_resources.parse_args(['--digests', 'write']).digests == 'write'


@pytest.mark.parametrize('dtype', MAX_SPILL)
def test_launch_settings_keep_register_spills_small(rows, dtype):
    spilling = [
        (row['model'], row['kernel'], row['head_dim'], row['spill_stores'])
        for row in rows
        if row['dtype'] == dtype and row['spill_stores'] > MAX_SPILL[dtype]
    ]
    assert not spilling


@pytest.mark.parametrize('tool', [triton_resources, triton_tuning], ids=('triton_resources', 'triton_tuning'))
@pytest.mark.parametrize(
    'argv,message',
    [
        (['--models', 'vil-x'], r"--models: unknown value\(s\) \['vil-x'\]; choose from \['vil-s'"),
        (['--dtypes', 'fp16'], r"--dtypes: unknown value\(s\) \['fp16'\]"),
        (['--size', '256'], '--size: .256. is not HEIGHTxWIDTH'),
    ],
    ids=['model', 'dtype', 'size'],
)
def test_bad_options_name_the_choices(tool, argv, message):
    with pytest.raises(SystemExit, match=message):
        tool.parse_args(argv)


def test_tuning_times_each_kernel_with_the_package_and_candidate_settings(interpreted):
    result = interpreted['tuning']
    assert 'error' not in result, result.get('error')
    kernels = {'_sliding_chunk_forward', '_sliding_chunk_backward_queries', '_sliding_chunk_backward_keys'}
    for name, times in (('package', result['package']), ('candidate', result['candidate'])):
        assert {key.split(' ')[0] for key in times} == kernels, name
        assert all(ms > 0 for _, ms in times.values()), name
    # fp32: launch_settings; the kernel with the bias-gradient atomics names its copies.
    copies = ', 32 copies'
    assert {key.split(' ')[0]: label for key, (label, _) in result['package'].items()} == {
        '_sliding_chunk_forward': '8w1s',
        '_sliding_chunk_backward_queries': '8w1s' + copies,
        '_sliding_chunk_backward_keys': '8w1s',
    }
    assert {label.replace(copies, '') for label, _ in result['candidate'].values()} == {'2w2s'}
    # With another count of copies, only that kernel is timed; with 0, the bias-gradient kernel's time is counted
    # as its own.
    assert {key.split(' ')[0]: label for key, (label, _) in result['copies'].items()} == {
        '_sliding_chunk_backward_queries': '8w1s, 0 copies'
    }
    # With packed tiles, the kernels that loop over them are timed (every sliding-chunk kernel).
    assert {key.split(' ')[0]: label for key, (label, _) in result['packed'].items()} == {
        '_sliding_chunk_forward': '8w1s, packed keys',
        '_sliding_chunk_backward_queries': '8w1s' + copies + ', packed keys',
        '_sliding_chunk_backward_keys': '8w1s, packed keys',
    }
    # The command line: per kernel the package's settings and the candidates; a CSV line for each.
    assert sorted(kernel for kernel, *_ in result['table']) == sorted(kernels)
    assert {(kernel, settings) for kernel, settings, _ in result['table']} == {
        (kernel, 'package (8w1s' + (copies if 'queries' in kernel else '') + ')') for kernel in kernels
    }
    assert {best for kernel, _, best in result['table'] if 'queries' not in kernel} <= {
        '2w2s',
        '8w1s, packed keys',
        '2w1s, packed keys',
    }
    # The package's and the candidate's rows, the copies' and the packed tiles' (the package's settings and each of
    # --warps).
    assert result['csv_lines'] == 1 + 2 * len(kernels) + 1 + 2 * len(kernels)
    # --write after measuring: the package's table (here a copy) names the device and the CSV it chose from.
    assert result['tuned_from'] == ['cpu (Triton interpreter): <out>/triton_tuning.csv']


def test_best_rows_pick_the_fastest_compiling_candidate():
    base = dict(model='vil-s', dtype='bf16', kernel='_k', inputs='bf16', head_dim=32, tile=64)
    rows = [
        dict(base, settings='package (4w3s)', time_ms=2.0),
        dict(base, settings='8w3s', time_ms=1.0),
        dict(base, settings='16w3s', time_ms=None),
        dict(base, settings='4w1s', time_ms=1.5),
    ]
    (best,) = triton_tuning.best_rows(rows)
    assert (best['settings'], best['best_settings'], best['speedup']) == ('package (4w3s)', '8w3s', 2.0)


def test_tuned_launches_take_a_candidate_faster_wherever_the_kernel_ran_and_are_written_as_read(tmp_path):
    """``triton_tuning.py --write`` puts a candidate into visattn_mm/ops/tuned_launches.py only where it was at
    least 5% faster over every model and token tile its kernel ran at, and compiled for all of them; other
    counts of bias-gradient copies are not launch settings; rows of kernels not timed stay. The module it
    writes reads back as the table, formatted as ruff formats it, and the committed one is what it writes."""
    from visattn_mm.ops import tuned_launches

    def row(model, kernel, settings, ms, tile=64):
        time_ms = '' if ms is None else str(ms)
        fields = dict(model=model, kernel=kernel, settings=settings, time_ms=time_ms, tile=str(tile))
        return dict(fields, device='GPU', dtype='bf16', inputs='bf16', head_dim='32', status='ok')

    rows = [
        # 1.5x on both models and both of ViL-LS' tiles: written.
        row('vil-s', '_a', 'package (4w3s)', 3.0),
        row('vil-s', '_a', '8w1s', 2.0),
        row('vil-s', '_a', '2w2s', 2.5),
        row('vil-ls-s', '_a', 'package (4w3s)', 1.5),
        row('vil-ls-s', '_a', '8w1s', 1.0),
        row('vil-ls-s', '_a', 'package (4w3s)', 1.5, tile=128),
        row('vil-ls-s', '_a', '8w1s', 1.0, tile=128),
        # The fastest does not compile for one model, the other gains 2%: the package's settings stay.
        row('vil-s', '_b', 'package (4w3s, 32 copies)', 1.0),
        row('vil-s', '_b', '8w1s, 32 copies', 0.5),
        row('vil-s', '_b', '2w2s, 32 copies', 0.98),
        row('vil-s', '_b', '4w3s, 0 copies', 0.1),
        row('vil-ls-s', '_b', 'package (4w3s, 32 copies)', 1.0),
        row('vil-ls-s', '_b', '8w1s, 32 copies', None),
        row('vil-ls-s', '_b', '2w2s, 32 copies', 0.98),
    ]
    current = {('_c', 'fp32', 64): dict(num_warps=8, num_stages=1)}
    table, report = triton_tuning.chosen_launches(rows, current)
    assert table == {('_a', 'bf16', 32): dict(num_warps=8, num_stages=1), **current}
    assert {r['kernel']: (r['best'], round(r['speedup'], 2), r['written']) for r in report} == {
        '_a': ('8w1s', 1.5, 'yes'),
        '_b': ('2w2s', 1.02, 'no'),
    }
    path = tmp_path / 'tuned_launches.py'
    path.write_text('"""The doc."""\n\n# A comment.\nTUNED_FROM = []\nTUNED_LAUNCHES = {}\n')
    triton_tuning.write_tuned(table, ['GPU: results/call/triton_tuning.csv'], path)
    written = {}
    exec(path.read_text(), written)
    assert written['TUNED_LAUNCHES'] == table and written['TUNED_FROM'] == ['GPU: results/call/triton_tuning.csv']
    assert path.read_text().startswith('"""The doc."""\n\n# A comment.\nTUNED_FROM = [\n')
    ruff = shutil.which('ruff', path=str(Path(sys.executable).parent)) or shutil.which('ruff')
    check = subprocess.run(
        [ruff, 'format', '--check', '--no-cache', '--config', str(ROOT / 'pyproject.toml'), str(path)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    committed = Path(tuned_launches.__file__).read_text()
    assert committed.endswith(triton_tuning.tuned_source(tuned_launches.TUNED_LAUNCHES, tuned_launches.TUNED_FROM))


def tuning_run():
    """kernel_times of a tiny ViL in fp32 with the package's settings and with :data:`CANDIDATE`, and the
    command line on the same model: its table rows and CSV lines."""
    import tempfile

    from helpers import TINY_ARCHS
    from visattn_mm.ops import tuned_launches

    torch.manual_seed(0)
    model = build_tiny(ViL, attn_impl='triton', drop_path_rate=0.0).train()
    image = torch.randn(1, 3, 32, 48)
    result = {
        name: {
            ' '.join(map(str, key)): value
            for key, value in triton_tuning.kernel_times(model, image, 'fp32', candidate, 1, copies, packed).items()
        }
        for name, candidate, copies, packed in (
            ('package', None, None, False),
            ('candidate', CANDIDATE, None, False),
            ('copies', None, 0, False),
            ('packed', None, None, True),
        )
    }
    triton_tuning.MODELS = {'vil-tiny': ('ViL', TINY_ARCHS[ViL])}
    with tempfile.TemporaryDirectory() as out_dir:
        shutil.copy(tuned_launches.__file__, f'{out_dir}/tuned_launches.py')
        table = triton_tuning.main(
            [
                '--device',
                'cpu',
                '--models',
                'vil-tiny',
                '--dtypes',
                'fp32',
                '--size',
                '32x48',
                '--batch',
                '1',
                '--warps',
                '2',
                '--stages',
                '2',
                '--bias-grad-copies',
                '1',
                '--repeats',
                '1',
                '--out-dir',
                out_dir,
                '--write',
                '--tuned-file',
                f'{out_dir}/tuned_launches.py',
            ]
        )
        with open(f'{out_dir}/triton_tuning.csv') as csv:
            result['csv_lines'] = len(csv.read().splitlines())
        written = {}
        exec(open(f'{out_dir}/tuned_launches.py').read(), written)
        result['tuned_from'] = [source.replace(out_dir, '<out>') for source in written['TUNED_FROM']]
    result['table'] = [(row['kernel'], row['settings'], row['best_settings']) for row in table]
    return result


if __name__ == '__main__':
    # The interpreter subprocess of the ``interpreted`` fixture: one JSON line on stdout.
    main(None, {}, tuning=tuning_run)
