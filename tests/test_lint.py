"""The tree passes the linter and the formatter configured in pyproject.toml (ruff: pycodestyle, pyflakes,
import order; black-style formatting with the quotes as written)."""

import shutil
import subprocess
import sys
from pathlib import Path

from paths import ROOT


def test_ruff_passes_on_the_whole_tree():
    ruff = shutil.which('ruff', path=str(Path(sys.executable).parent)) or shutil.which('ruff')
    assert ruff, 'ruff is not installed: it is pinned in requirements/stack.txt (tools/bootstrap.sh installs it)'
    proc = subprocess.run([ruff, 'check', '--no-cache', '.'], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_formatter_leaves_the_tree_unchanged():
    ruff = shutil.which('ruff', path=str(Path(sys.executable).parent)) or shutil.which('ruff')
    proc = subprocess.run([ruff, 'format', '--check', '--no-cache', '.'], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, 'run `ruff format .` (configured in pyproject.toml):\n' + proc.stdout + proc.stderr


def test_no_tool_module_is_named_like_a_package_module():
    """Tools import one another by their bare names (pytest's and the scripts' path): a tool named like a module
    of the package (``step_cost``, ``cuda_defaults``) sends go-to-definition to the wrong file."""
    package = {path.stem for path in (ROOT / 'visattn_mm').rglob('*.py')} - {'__init__'}
    tools = {path.stem: path.relative_to(ROOT).as_posix() for path in (ROOT / 'tools').rglob('*.py')}
    assert {name: path for name, path in tools.items() if name in package} == {}
