"""tools/gpu_session.sh: bash syntax, its CPU smoke mode end to end (wheel installation, the three
stages, the files and the summary line), later stages running after a failed one, and the GPU
benchmark options parsing (refused only for the missing GPU).

The script runs with ``CUDA_VISIBLE_DEVICES=''`` so that it does the same on a GPU machine.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / 'tools' / 'gpu_session.sh'
PROBE = 'gpu_session_probe'


def _run(tmp_path, *stages, **env):
    """Runs the script with ``stages``; returns the completed process (output in ``stdout``)."""
    env = {
        **os.environ,
        'PYTHON': sys.executable,
        'OUT': str(tmp_path / 'out'),
        'SITE': str(tmp_path / 'site'),
        'WHEEL_DIR': str(tmp_path / 'wheels'),
        'CUDA_VISIBLE_DEVICES': '',
        **env,
    }
    return subprocess.run(
        ['bash', str(SCRIPT), *stages],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
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


def test_script_is_bash_without_syntax_errors():
    assert SCRIPT.stat().st_mode & 0o111, 'tools/gpu_session.sh should be executable'
    subprocess.run(['bash', '-n', str(SCRIPT)], check=True)


def test_smoke_mode_runs_every_stage_on_the_cpu(tmp_path):
    _write_probe_wheel(tmp_path / 'wheels')
    result = _run(tmp_path, SMOKE='1')
    out = tmp_path / 'out'
    assert result.returncode == 0, result.stdout[-3000:]
    summary = (out / 'summary.txt').read_text().strip()
    assert re.fullmatch(r'gpu_session: setup ok, tests ok, bench ok in \d+ s', summary)
    assert result.stdout.strip().endswith(summary)
    assert sorted(p.name for p in out.iterdir()) == [
        'bench.log',
        'benchmark.csv',
        'benchmark.md',
        'benchmark.png',
        'setup.log',
        'summary.txt',
        'tests.log',
        'tests.xml',
    ]

    # setup: the wheel installed into SITE, which the stages import from; the environment report.
    assert (tmp_path / 'site' / PROBE / '__init__.py').exists()
    setup = (out / 'setup.log').read_text()
    assert f'installing 1 wheels from {tmp_path / "wheels"}/' in setup
    assert f'PYTHONPATH: {tmp_path / "site"}:{ROOT}' in setup
    assert re.search(r'^Triton: \d', setup, re.M) and 'setup: the backbones import' in setup
    # tests: the CUDA tests were collected, and all skipped here.
    suite = ElementTree.parse(out / 'tests.xml').getroot().find('testsuite')
    assert int(suite.get('tests')) > 50
    assert suite.get('skipped') == suite.get('tests') and suite.get('failures') == '0'
    assert suite.get('errors') == '0'
    # bench: both impls of our backbone and the baseline, the ratio table.
    with open(out / 'benchmark.csv', newline='') as f:
        rows = list(csv.DictReader(f))
    assert [(r['model'], r['impl'], r['mode'], r['status']) for r in rows] == [
        (model, impl, mode, 'ok')
        for model, impl in (('vil-t', 'fast'), ('vil-t', 'triton'), ('swin-t', '-'))
        for mode in ('fwd', 'fwd+bwd')
    ]
    table = (out / 'benchmark.md').read_text().splitlines()
    assert table[0].startswith('| model | impl |') and len(table) == 2 + len(rows)


def test_later_stages_run_after_a_failed_one(tmp_path):
    result = _run(tmp_path, 'tests', 'bench', SMOKE='1', BUDGET='0')
    assert result.returncode == 124
    assert result.stdout.count('BUDGET=0 s used up; not started') == 2
    assert (tmp_path / 'out' / 'summary.txt').read_text().startswith('gpu_session: tests STOPPED: BUDGET=0 s reached (')
    assert ', bench STOPPED: BUDGET=0 s reached (' in result.stdout


def test_unknown_stage_is_refused(tmp_path):
    result = _run(tmp_path, 'setup', 'benchmark')
    assert result.returncode == 2 and "unknown stage 'benchmark'" in result.stdout


def test_gpu_benchmark_options_parse(tmp_path):
    """The GPU run's benchmark.py options (models, sizes, impls) are accepted: without a GPU the
    only refusal is the device, which benchmark.py checks after the options."""
    result = _run(tmp_path, 'bench')
    assert result.returncode == 1
    assert '--device cuda: CUDA is not available here' in (tmp_path / 'out' / 'bench.log').read_text()
    assert 'bench FAILED (exit 1, ' in result.stdout
