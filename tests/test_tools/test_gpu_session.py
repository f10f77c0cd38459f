"""tools/gpu_session.sh: bash syntax, its CPU smoke mode end to end (wheel installation, the stages,
the profile's CSV in the log, the benchmark's grids in order, the files a device call brings back, the
summary line), the budget and
size of the device call, later stages running after a failed one, and the GPU benchmark options
parsing (refused only for the missing GPU). The rehearsal (a 5 GB environment with the host's
versions) is run by hand: docs/testing.md.

The script runs with ``CUDA_VISIBLE_DEVICES=''`` so that it does the same on a GPU machine.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ElementTree
import zipfile
from pathlib import Path

from paths import ROOT

SCRIPT = ROOT / 'tools' / 'gpu_session.sh'
PROBE = 'gpu_session_probe'


def _run(tmp_path, *stages, timeout=300, **env):
    """Runs the script with ``stages`` within ``timeout`` seconds; returns the completed process (output in
    ``stdout``)."""
    env = {
        **os.environ,
        'PYTHON': sys.executable,
        'OUT': str(tmp_path / 'out'),
        'SITE': str(tmp_path / 'site'),
        'WHEEL_DIR': str(tmp_path / 'wheels'),
        'CUDA_VISIBLE_DEVICES': '',
        # One pytest process per stage: the stages' CUDA tests all skip here.
        'TEST_WORKERS': '0',
        **env,
    }
    return subprocess.run(
        ['bash', str(SCRIPT), *stages],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
    )


def _write_probe_wheel(directory):
    """A minimal pure-Python wheel, standing in for the ones carried to the GPU host."""
    directory.mkdir()
    dist_info = f'{PROBE}-0.1.dist-info'
    files = {
        f'{PROBE}/__init__.py': 'VALUE = 1\n',
        f'{dist_info}/METADATA': f'Metadata-Version: 2.1\nName: {PROBE}\nVersion: 0.1\n',
        f'{dist_info}/WHEEL': 'Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n',
    }
    files[f'{dist_info}/RECORD'] = ''.join(f'{name},,\n' for name in [*files, f'{dist_info}/RECORD'])
    with zipfile.ZipFile(directory / f'{PROBE}-0.1-py3-none-any.whl', 'w') as wheel:
        for name, text in files.items():
            wheel.writestr(name, text)


def _path_without_sanitizer():
    """PATH without the folders that hold a compute-sanitizer (a CUDA toolkit on this machine)."""
    folders = os.environ.get('PATH', '').split(os.pathsep)
    return os.pathsep.join(f for f in folders if not (Path(f) / 'compute-sanitizer').exists())


def test_script_is_bash_without_syntax_errors():
    assert SCRIPT.stat().st_mode & 0o111, 'tools/gpu_session.sh should be executable'
    subprocess.run(['bash', '-n', str(SCRIPT)], check=True)


def test_smoke_mode_runs_the_device_call_on_the_cpu(tmp_path):
    """The device call's stages in their CPU smoke mode (the tuning stage's interpreter run is
    tests/test_ops/test_triton/test_triton_resources.py's): its files, the order of the benchmark's grids, a summary."""
    _write_probe_wheel(tmp_path / 'wheels')
    result = _run(
        tmp_path,
        'setup',
        'tests',
        'profile',
        'sanitize',
        'decide',
        'graphs',
        'bench',
        'compile',
        SMOKE='1',
        PATH=_path_without_sanitizer(),
        CUDA_HOME=str(tmp_path / 'no-cuda'),
    )
    out = tmp_path / 'out'
    assert result.returncode == 0, result.stdout[-3000:]
    summary = (out / 'summary.txt').read_text().strip()
    assert re.fullmatch(
        rf'gpu_session: setup ok, tests ok, profile ok, sanitize ok, decide ok, graphs ok, bench ok, compile ok '
        rf'in \d+ s \(log: {out}/session.log\)',
        summary,
    )
    assert result.stdout.strip().endswith(summary)
    # What a device call brings back: at most 8 files, none in a folder; past 7, all but the log and the
    # summary in one archive.
    files = sorted(p.name for p in out.iterdir())
    assert files == ['results.tar.gz', 'session.log', 'summary.txt']
    with tarfile.open(out / 'results.tar.gz') as archive:
        archive.extractall(out, filter='data')
    packed = ['benchmark.csv', 'benchmark.md', 'compile.xml', 'decide.csv', 'decide.md', 'tests.xml']
    assert sorted(p.name for p in out.iterdir() if p.name not in files) == packed
    assert all((out / name).is_file() for name in packed)

    log = (out / 'session.log').read_text()
    stages = ['install', 'setup', 'tests', 'profile', 'sanitize', 'decide', 'graphs', 'bench', 'compile']
    assert re.findall(r'^=== (\w+)', log, re.M) == stages
    assert 'packed 6 files into' in log
    assert 'no compute-sanitizer here: sanitize skipped' in log
    assert 'CUDA graphs need a GPU: graphs skipped' in log
    # install and setup: the wheel installed into SITE, which the stages import from; the environment report,
    # and this environment's versions against the rehearsal's pins.
    assert (tmp_path / 'site' / PROBE / '__init__.py').exists()
    assert f'installing 1 wheels from {tmp_path / "wheels"}/' in log
    assert f'PYTHONPATH: {tmp_path / "site"}:{ROOT}' in log
    assert re.search(r'^Triton: \d', log, re.M) and 'setup: the backbones import' in log
    assert re.search(r'^torch: \S+', log, re.M) and re.search(r'^triton: \S+', log, re.M)
    # tests: the CUDA tests were collected, and all skipped here.
    suite = ElementTree.parse(out / 'tests.xml').getroot().find('testsuite')
    assert int(suite.get('tests')) > 50
    assert suite.get('skipped') == suite.get('tests') and suite.get('failures') == '0'
    assert suite.get('errors') == '0'
    compiled = ElementTree.parse(out / 'compile.xml').getroot().find('testsuite')
    assert int(compiled.get('tests')) >= 1 and compiled.get('skipped') == compiled.get('tests')
    # profile: its table, then its CSV in the log: a totals row and classes for each model.
    profile = re.search(r'^--- profile_step\.csv\n(.*?)^--- end profile_step\.csv$', log, re.M | re.S)
    assert profile, log[-3000:]
    profiled = list(csv.DictReader(profile.group(1).splitlines()))
    totals = [(r['model'], r['batch'], r['status']) for r in profiled if r['kernel_class'] == 'all']
    assert totals == [('swin-t', '1', 'ok'), ('vil-t', '1', 'ok')]
    assert {'gemm', 'norm', 'elementwise'} <= {r['kernel_class'] for r in profiled}
    assert re.search(r'^\| swin-t \| - \| 1 \| ', log, re.M) and re.search(r'^\| vil-t \| auto \| 1 \| ', log, re.M)
    # decide, then bench: grid by grid, the baseline first in each, both paths of the decision grid.
    expected = dict(
        decide=[
            ('swin-t', '-', 'fwd+bwd'),
            ('r50', '-', 'fwd+bwd'),
            ('vil-t', 'fast', 'fwd+bwd'),
            ('vil-t', 'triton', 'fwd+bwd'),
        ],
        benchmark=[('swin-t', '-', 'fwd'), ('r50', '-', 'fwd'), ('vil-t', 'math', 'fwd')],
    )
    for name, cases in expected.items():
        with open(out / f'{name}.csv', newline='') as f:
            rows = list(csv.DictReader(f))
        assert [(r['model'], r['impl'], r['mode']) for r in rows] == cases
        assert all(r['status'] == 'ok' and r['time_ms_vs_swin-t'] for r in rows)
        table = (out / f'{name}.md').read_text().splitlines()
        assert table[0].startswith('| model | impl |') and len(table) == 2 + len(rows)


def test_detector_stage_trains_and_tests_a_real_config_on_toy_data(tmp_path):
    """The detector stage in its CPU smoke mode, on the demo's Mask R-CNN ViL-T alone (UperNet's 512x512 crops
    take minutes here: the rehearsal runs them): tools/train.py for one iteration and tools/test.py on its
    checkpoint, on toy data written beside the config."""
    scratch = tmp_path / 'scratch'
    result = _run(
        tmp_path,
        'detector',
        SMOKE='1',
        DETECTORS='configs/demo/maskrcnn_vil_t_toy.py',
        DETECTOR_ITERS='1',
        SCRATCH=str(scratch),
        timeout=900,  # about 2 minutes on an idle 2-core machine: three processes that import mmdet, one step
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert (tmp_path / 'out' / 'summary.txt').read_text().startswith('gpu_session: detector ok in ')
    assert (scratch / 'toy_coco_128x160' / 'maskrcnn_vil_t_toy_toy.py').is_file()
    assert (scratch / 'maskrcnn_vil_t_toy' / 'train' / 'iter_1.pth').is_file()
    log = (tmp_path / 'out' / 'session.log').read_text()
    assert re.search(r'Iter\(test\) \[\d+/\d+\] +coco/bbox_mAP: ', log), log[-3000:]


def test_device_call_fits_its_budget_and_carry():
    """The documented device call: one command, 480 s for its stages by default, the tests capped, and
    a working tree (with the wheels) well inside the 64 MiB a call carries."""
    text = SCRIPT.read_text()
    assert 'BUDGET="${BUDGET:-480}"' in text and 'TESTS_BUDGET="${TESTS_BUDGET:-180}"' in text
    assert 'stages=(setup tests profile sanitize decide graphs detector throughput bench compile tune)' in text
    assert 'PROFILE_BUDGET="${PROFILE_BUDGET:-60}"' in text
    tracked = subprocess.run(['git', 'ls-files', '-z'], cwd=ROOT, capture_output=True, check=True).stdout
    size = sum((ROOT / name).stat().st_size for name in tracked.decode().split('\0') if (ROOT / name).is_file())
    # The carried wheels: mmcv with its CUDA ops (about 30 MB) and the rest (about 10 MB).
    assert size < 16 * 2**20, f'the tracked files are {size / 2**20:.1f} MiB; a device call carries 64 MiB in all'


def test_later_stages_run_after_a_failed_one(tmp_path):
    result = _run(tmp_path, 'tests', 'profile', 'bench', SMOKE='1', BUDGET='0')
    assert result.returncode == 124
    assert result.stdout.count('BUDGET=0 s used up; not started') == 3
    summary = (tmp_path / 'out' / 'summary.txt').read_text()
    stopped = ', '.join(f'{stage} STOPPED: BUDGET=0 s reached' for stage in ('tests', 'profile', 'bench'))
    assert summary.startswith(f'gpu_session: {stopped} in ')


def test_unknown_stage_is_refused(tmp_path):
    result = _run(tmp_path, 'setup', 'benchmark')
    assert result.returncode == 2 and "unknown stage 'benchmark'" in result.stdout
    assert 'rehearse' in result.stdout  # the stages it names


def test_gpu_benchmark_options_parse(tmp_path):
    """The GPU run's benchmark.py options (models, sizes, impls) are accepted: without a GPU the
    only refusal is the device, which benchmark.py checks after the options (the graphs stage's too)."""
    result = _run(tmp_path, 'bench', 'graphs')
    assert result.returncode == 1
    log = (tmp_path / 'out' / 'session.log').read_text()
    assert log.count('--device cuda: CUDA is not available here') == 2
    assert 'bench FAILED (exit 1), graphs FAILED (exit 1)' in result.stdout
