"""The tree passes the linter and the formatter configured in pyproject.toml (ruff: pycodestyle, pyflakes,
import order; black-style formatting with the quotes as written)."""

import ast
import importlib.metadata
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
    """A tool named like a module of the package (``step_cost``, ``cuda_defaults``) sends go-to-definition and a
    reader's search to the wrong file."""
    package = {path.stem for path in (ROOT / 'visattn_mm').rglob('*.py')} - {'__init__'}
    tools = {path.stem: path.relative_to(ROOT).as_posix() for path in (ROOT / 'tools').rglob('*.py')}
    assert {name: path for name, path in tools.items() if name in package} == {}


def test_tools_import_only_the_package_and_installed_libraries():
    """Every tool is a script run by its path: it imports from ``visattn_mm``, the standard library and installed
    distributions, never another tool as a bare module (that works only where the importing script's folder, or
    pytest's ``pythonpath``, is on ``sys.path``). Code that several tools share lives in ``visattn_mm/analysis/``."""
    tools = ROOT / 'tools'
    siblings = {path.stem for path in tools.rglob('*.py')} | {path.name for path in tools.rglob('*') if path.is_dir()}
    installed = set(importlib.metadata.packages_distributions())
    wrong = []
    for path in sorted(tools.rglob('*.py')):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ''] if node.level == 0 else ['.' * node.level + (node.module or '')]
            else:
                continue
            for name in names:
                top = name.split('.')[0]
                if (
                    name.startswith('.')
                    or top in siblings
                    or not (top == 'visattn_mm' or top in sys.stdlib_module_names or top in installed)
                ):
                    wrong.append(f'{path.relative_to(ROOT)}:{node.lineno}: import {name}')
    assert wrong == [], 'tools import another tool, or a module that is not installed:\n' + '\n'.join(wrong)
