"""tools/dist_train.sh and tools/dist_test.sh before torchrun starts: usage and the interpreter.

The launchers run from a copy of tools/ in a scratch repository, with a fake
``python`` that prints how it was called, so no process group is started.
(tests/test_tools/test_tools_cli.py runs dist_train.sh for real.)
"""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from paths import ROOT

LAUNCHERS = ('dist_train.sh', 'dist_test.sh', '_torchrun.sh')
# Answers the launcher's torch probe (`python -c ...`) with `HAS_TORCH`, and
# otherwise prints its arguments instead of starting torchrun.
FAKE_PYTHON = '''#!/bin/sh
if [ "$1" = "-c" ]; then exit {exit_code}; fi
echo "{name} $@"
'''


def _fake_python(path: Path, has_torch: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE_PYTHON.format(exit_code=0 if has_torch else 1, name=path))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def repo(tmp_path) -> Path:
    """A scratch repository with the launchers and a PATH holding only a python3 without torch."""
    (tmp_path / 'tools').mkdir()
    for name in LAUNCHERS:
        shutil.copy(ROOT / 'tools' / name, tmp_path / 'tools' / name)
    bin_dir = tmp_path / 'bin'
    _fake_python(bin_dir / 'python3', has_torch=False)
    for tool in ('bash', 'dirname', 'sh'):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return tmp_path


def _launch(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != 'PYTHON'}
    environ.update(PATH=str(repo / 'bin'), **env)
    return subprocess.run(
        [shutil.which('bash'), str(repo / 'tools' / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        env=environ,
        timeout=60,
    )


@pytest.mark.parametrize('script,needed', [('dist_train.sh', 2), ('dist_test.sh', 3)])
def test_too_few_arguments_print_the_usage(repo, script, needed):
    for count in range(needed):
        proc = _launch(repo, script, *['x'] * count)
        assert proc.returncode == 2
        assert proc.stderr.startswith(f'usage: [PYTHON=.venv/bin/python] bash tools/{script} CONFIG')
        assert 'unbound variable' not in proc.stderr


def test_no_python_with_torch_names_what_to_set(repo):
    proc = _launch(repo, 'dist_train.sh', 'cfg.py', '2')
    assert proc.returncode == 2
    assert 'found no Python with torch' in proc.stderr and 'Set PYTHON' in proc.stderr
    assert 'No module named' not in proc.stderr


def test_the_repository_venv_is_found_without_python_set(repo):
    venv_python = repo / '.venv' / 'bin' / 'python'
    _fake_python(venv_python, has_torch=True)
    proc = _launch(repo, 'dist_train.sh', 'cfg.py', '2', '--resume')
    assert proc.returncode == 0, proc.stderr
    called = proc.stdout.split()
    assert called[0] == str(venv_python)
    assert called[1:3] == ['-m', 'torch.distributed.run'] and '--nproc_per_node=2' in called
    assert called[-5:] == [str(repo / 'tools' / 'train.py'), '--launcher', 'pytorch', 'cfg.py', '--resume']
    # PYTHON, when set, wins; a python on PATH with torch is the last resort.
    chosen = repo / 'other' / 'python'
    _fake_python(chosen, has_torch=True)
    assert _launch(repo, 'dist_test.sh', 'cfg.py', 'ckpt.pth', '1', PYTHON=str(chosen)).stdout.startswith(
        f'{chosen} -m torch.distributed.run'
    )
    venv_python.unlink()
    _fake_python(repo / 'bin' / 'python3', has_torch=True)
    assert _launch(repo, 'dist_train.sh', 'cfg.py', '2').stdout.startswith(
        f'{repo / "bin" / "python3"} -m torch.distributed.run'
    )
