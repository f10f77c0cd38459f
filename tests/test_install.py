"""Install logic: the bootstrap's choices, the lock against setup.cfg's ranges, mim.

- tools/mmcv_build_plan.py decides the mmcv flavour (CPU or CUDA ops) and the wheel-cache
  key; it is tested here on described machines, since CI has no GPU.
- tools/bootstrap.sh refuses an unsupported Python before it touches anything; run from
  a copy in a temporary folder with fake interpreters, so it cannot reach a real one.
- The exact pins of requirements/stack.txt satisfy setup.cfg's compatible ranges.
- mim finds the package: ``mim search`` lists every config (model-index.yml is current)
  and ``mim train`` runs tools/train.py from the package on a config found by name.
"""

from __future__ import annotations

import configparser
import dataclasses
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from paths import ROOT

TOOLS = ROOT / 'tools'


def _load(path: Path):
    """Import a script (tools/x.py, setup.py) under a private module name."""
    spec = importlib.util.spec_from_file_location(f'_visattn_install_{path.stem}', path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


plan = _load(TOOLS / 'mmcv_build_plan.py')
model_index = _load(TOOLS / 'make_model_index.py')

CPU_MACHINE = plan.Machine(
    python='3.11', torch='2.12.1', torch_cuda='13.0', gpu_capabilities=(), nvcc=None, nvcc_cuda=None, cores=2
)
GPU_MACHINE = dataclasses.replace(
    CPU_MACHINE, gpu_capabilities=((9, 0), (8, 0), (9, 0)), nvcc='/usr/local/cuda/bin/nvcc', nvcc_cuda='13.0', cores=16
)


# --------------------------------------------------------------------------
# mmcv flavour and wheel-cache key
# --------------------------------------------------------------------------
def test_cpu_machine_builds_cpu_ops():
    chosen = plan.make_plan(CPU_MACHINE, {})
    assert chosen.flavour == 'cpu'
    assert chosen.build_env == {'MMCV_WITH_OPS': '1', 'FORCE_CUDA': '0', 'MAX_JOBS': '2'}
    assert chosen.cache_key == 'torch-2.12.1-cp311-cpu'


def test_gpu_with_nvcc_builds_cuda_ops_for_the_local_architectures():
    chosen = plan.make_plan(GPU_MACHINE, {})
    assert chosen.flavour == 'cuda'
    assert chosen.build_env == {
        'MMCV_WITH_OPS': '1',
        'FORCE_CUDA': '1',
        'MAX_JOBS': '16',
        'TORCH_CUDA_ARCH_LIST': '8.0;9.0',
    }
    assert chosen.cache_key == 'torch-2.12.1-cp311-cuda13.0-arch8.0_9.0'


def test_user_settings_win_over_the_detected_ones():
    chosen = plan.make_plan(GPU_MACHINE, {'MAX_JOBS': '4', 'TORCH_CUDA_ARCH_LIST': '8.6+PTX'})
    assert chosen.build_env['MAX_JOBS'] == '4'
    assert chosen.build_env['TORCH_CUDA_ARCH_LIST'] == '8.6+PTX'
    assert chosen.cache_key.endswith('-arch8.6+PTX')


def test_gpu_without_nvcc_names_both_ways_forward():
    with pytest.raises(plan.PlanError) as err:
        plan.make_plan(dataclasses.replace(GPU_MACHINE, nvcc=None, nvcc_cuda=None), {})
    message = str(err.value)
    assert 'no CUDA compiler (nvcc)' in message
    assert 'install the CUDA toolkit 13.0' in message
    assert f'set {plan.CPU_ONLY_FLAG}=1' in message


def test_cpu_only_flag_builds_cpu_ops_on_a_gpu_machine():
    no_nvcc = dataclasses.replace(GPU_MACHINE, nvcc=None, nvcc_cuda=None)
    chosen = plan.make_plan(no_nvcc, {plan.CPU_ONLY_FLAG: '1'})
    assert chosen.flavour == 'cpu' and chosen.build_env['FORCE_CUDA'] == '0'
    assert plan.CPU_ONLY_FLAG in chosen.note


def test_nvcc_of_another_cuda_major_is_refused():
    with pytest.raises(plan.PlanError, match='major versions must agree'):
        plan.make_plan(dataclasses.replace(GPU_MACHINE, nvcc_cuda='12.4'), {})


def test_cache_key_differs_across_flavour_torch_python_and_cuda():
    machines = [
        CPU_MACHINE,
        GPU_MACHINE,
        dataclasses.replace(CPU_MACHINE, torch='2.13.0'),
        dataclasses.replace(CPU_MACHINE, python='3.12'),
        dataclasses.replace(GPU_MACHINE, torch_cuda='13.1', nvcc_cuda='13.1'),
        dataclasses.replace(GPU_MACHINE, gpu_capabilities=((8, 6),)),
    ]
    keys = [plan.make_plan(machine, {}).cache_key for machine in machines]
    assert len(set(keys)) == len(keys), keys


def test_this_machine_is_described_and_planned():
    """The real facts of this interpreter's torch give a plan the bootstrap can read."""
    import torch

    machine = plan.describe_machine()
    assert machine.torch == torch.__version__
    assert machine.python == f'{sys.version_info.major}.{sys.version_info.minor}'
    lines = plan.plan_lines(plan.make_plan(machine, {plan.CPU_ONLY_FLAG: '1'}))
    assert lines[0] == 'flavour=cpu'
    assert 'FORCE_CUDA=0' in lines


def test_a_gpu_machine_is_described_from_torch_and_nvcc(tmp_path, monkeypatch):
    """torch's view of two GPUs (mocked) and an nvcc found in CUDA_HOME give the CUDA plan."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    cuda_home = tmp_path / 'cuda'
    (cuda_home / 'bin').mkdir(parents=True)
    nvcc = cuda_home / 'bin' / 'nvcc'
    nvcc.write_text('#!/bin/sh\necho "Cuda compilation tools, release 13.0, V13.0.88"\n')
    nvcc.chmod(0o755)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    monkeypatch.setattr(torch.cuda, 'get_device_capability', lambda i: [(9, 0), (8, 6)][i])
    monkeypatch.setattr(torch.version, 'cuda', '13.0')
    monkeypatch.setattr(cpp_extension, 'CUDA_HOME', str(cuda_home))

    machine = plan.describe_machine()
    assert machine.gpu_capabilities == ((9, 0), (8, 6))
    assert (machine.nvcc, machine.nvcc_cuda) == (str(nvcc), '13.0')
    assert plan.make_plan(machine, {}).build_env['TORCH_CUDA_ARCH_LIST'] == '8.6;9.0'


# --------------------------------------------------------------------------
# tools/bootstrap.sh: Python choice (from a copy, with fake interpreters only)
# --------------------------------------------------------------------------
@pytest.fixture
def bootstrap_copy(tmp_path) -> Path:
    """tools/bootstrap.sh in an empty checkout, and a bin folder with fake interpreters."""
    (tmp_path / 'tools').mkdir()
    shutil.copy(TOOLS / 'bootstrap.sh', tmp_path / 'tools')
    fake_bin = tmp_path / 'bin'
    fake_bin.mkdir()
    for tool in ('dirname',):  # the only command the script needs before choosing
        (fake_bin / tool).symlink_to(shutil.which(tool))
    return tmp_path


def _fake_python(folder: Path, name: str, version: str) -> Path:
    path = folder / name
    path.write_text(f'#!/bin/sh\necho {version}\n')
    path.chmod(0o755)
    return path


def _bootstrap(root: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [shutil.which('bash'), str(root / 'tools' / 'bootstrap.sh')],
        capture_output=True,
        text=True,
        timeout=30,
        env={'HOME': str(root), **env},
    )


def test_bootstrap_refuses_an_unsupported_python(bootstrap_copy):
    python = _fake_python(bootstrap_copy / 'bin', 'python3.10', '3.10')
    proc = _bootstrap(bootstrap_copy, {'PATH': str(bootstrap_copy / 'bin'), 'PYTHON': str(python)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f'PYTHON={python} is Python 3.10' in proc.stderr
    assert 'supports Python 3.11 and 3.12' in proc.stderr
    assert not (bootstrap_copy / '.venv').exists()


def test_bootstrap_says_which_pythons_it_found(bootstrap_copy):
    _fake_python(bootstrap_copy / 'bin', 'python3', '3.13')
    proc = _bootstrap(bootstrap_copy, {'PATH': str(bootstrap_copy / 'bin')})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert 'no Python 3.11 or 3.12 found (seen: python3=3.13)' in proc.stderr
    assert 'PYTHON=/path/to/python3.11' in proc.stderr


def test_bootstrap_finds_a_pyenv_python_its_shim_does_not_select(bootstrap_copy):
    """PYTHON=python3.12 where pyenv's shim answers 'command not found' (another global
    version): the interpreter under pyenv's versions folder is taken (here a 3.10, so that
    the test ends at the refusal naming it instead of building anything)."""
    fake_bin = bootstrap_copy / 'bin'
    shim = fake_bin / 'python3.12'
    shim.write_text('#!/bin/sh\necho "pyenv: python3.12: command not found" >&2\nexit 127\n')
    shim.chmod(0o755)
    pyenv_root = bootstrap_copy / 'pyenv'
    (pyenv_root / 'versions' / '3.12.1' / 'bin').mkdir(parents=True)
    real = _fake_python(pyenv_root / 'versions' / '3.12.1' / 'bin', 'python3.12', '3.10')
    pyenv = fake_bin / 'pyenv'
    pyenv.write_text(
        f'#!/bin/sh\ncase "$1" in\n  root) echo {pyenv_root} ;;\n'
        f'  whence) [ "$2" = python3.12 ] && echo 3.12.1 ;;\nesac\n'
    )
    pyenv.chmod(0o755)
    proc = _bootstrap(bootstrap_copy, {'PATH': str(fake_bin), 'PYTHON': 'python3.12'})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f'PYTHON={real} is Python 3.10' in proc.stderr


def test_bootstrap_refuses_a_disk_too_full_for_the_stack(bootstrap_copy):
    """Before it creates .venv/, with a supported Python: a disk with 3 GB free is refused,
    naming what is free, what the stack needs and the fix (pip would fail minutes later)."""
    for name in ('tools/mmcv_build_plan.py', 'requirements/stack.txt', 'setup.cfg', 'setup.py', 'pyproject.toml'):
        (bootstrap_copy / name).parent.mkdir(exist_ok=True)
        (bootstrap_copy / name).touch()
    fake_bin = bootstrap_copy / 'bin'
    for tool in ('cat', 'sha256sum', 'cut', 'grep', 'awk'):
        (fake_bin / tool).symlink_to(shutil.which(tool))
    df = fake_bin / 'df'
    df.write_text(
        '#!/bin/sh\necho "Filesystem 1024-blocks Used Available Capacity Mounted on"\n'
        'echo "/dev/x 100000000 96854528 3145728 97% /"\n'
    )
    df.chmod(0o755)
    python = _fake_python(fake_bin, 'python3.11', '3.11')
    proc = _bootstrap(bootstrap_copy, {'PATH': str(fake_bin), 'PYTHON': str(python)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f'3 GB free on the disk of {bootstrap_copy}; installing the stack needs about 10 GB' in proc.stderr
    assert 'set TMPDIR to a larger disk' in proc.stderr
    assert not (bootstrap_copy / '.venv').exists()


# --------------------------------------------------------------------------
# Lock file against setup.cfg
# --------------------------------------------------------------------------
def _lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / 'requirements' / 'stack.txt').read_text().splitlines():
        if line.strip() and not line.startswith('#'):
            requirement = Requirement(line)
            (specifier,) = requirement.specifier
            assert specifier.operator == '==', f'the lock pins exact versions: {line}'
            pins[requirement.name.lower()] = specifier.version
    return pins


def test_lock_pins_satisfy_the_compatible_ranges():
    setup_cfg = configparser.ConfigParser()
    setup_cfg.read(ROOT / 'setup.cfg')
    requirements = [Requirement(line) for line in setup_cfg['options']['install_requires'].strip().splitlines()]
    pins = _lock_pins()
    for requirement in requirements:
        name = requirement.name.lower()
        assert name in pins, f'{name} is required by setup.cfg but not pinned in the lock'
        assert requirement.specifier.contains(pins[name]), (str(requirement), pins[name])
    python_requires = Requirement(f"python{setup_cfg['options']['python_requires']}").specifier
    bootstrap = (TOOLS / 'bootstrap.sh').read_text()
    for version in ('3.11', '3.12'):
        assert f'Python :: {version}' in setup_cfg['metadata']['classifiers']
    assert 'SUPPORTED_PYTHONS="3.11 3.12"' in bootstrap
    # pip must accept exactly the versions the bootstrap sets up (it accepted 3.13, which the bootstrap refuses).
    accepted = [f'3.{minor}' for minor in range(8, 16) if python_requires.contains(f'3.{minor}.0')]
    assert accepted == ['3.11', '3.12'], python_requires


def test_lock_pins_every_extra_within_its_ranges():
    """The bootstrap installs the extras (export tests and mmdet's analyze_logs run in CI) at versions
    their ranges allow."""
    setup_cfg = configparser.ConfigParser()
    setup_cfg.read(ROOT / 'setup.cfg')
    extras = {
        name: [Requirement(line) for line in lines.strip().splitlines() if not line.startswith('#')]
        for name, lines in setup_cfg['options.extras_require'].items()
    }
    assert {r.name for r in extras['deploy']} == {'onnx', 'onnxruntime', 'onnxscript'}
    assert {r.name for r in extras['analysis']} == {'seaborn'}
    pins = _lock_pins()
    for requirement in extras['deploy'] + extras['analysis'] + extras['tests']:
        assert requirement.specifier.contains(pins[requirement.name.lower()]), (str(requirement), pins)


# --------------------------------------------------------------------------
# mim: model index, package layout, search and train
# --------------------------------------------------------------------------
def test_model_index_is_current_and_refuses_unknown_names():
    proc = subprocess.run(
        [sys.executable, str(TOOLS / 'make_model_index.py'), '--check'], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(ValueError, match='follows no pattern'):
        model_index.describe(Path('configs/fcos_vil_t_1x.py'))


def test_setup_links_for_develop_and_copies_for_a_wheel(tmp_path, monkeypatch):
    setup = _load(ROOT / 'setup.py')
    (tmp_path / 'visattn_mm').mkdir()
    (tmp_path / 'configs').mkdir()
    (tmp_path / 'configs' / 'a.py').write_text('x = 1\n')
    (tmp_path / 'tools').mkdir()
    (tmp_path / 'model-index.yml').write_text('Models: []\n')
    monkeypatch.setattr(setup, 'ROOT', tmp_path)
    mim = tmp_path / 'visattn_mm' / '.mim'

    setup.mirror_into_mim(link=True)
    assert (mim / 'configs').is_symlink() and (mim / 'configs' / 'a.py').read_text() == 'x = 1\n'
    assert (mim / 'model-index.yml').resolve() == tmp_path / 'model-index.yml'
    setup.mirror_into_mim(link=False)
    assert not (mim / 'configs').is_symlink() and (mim / 'configs' / 'a.py').is_file()
    assert not (mim / 'model-index.yml').is_symlink()
    assert (tmp_path / 'configs' / 'a.py').is_file()  # replacing the links kept the sources


def _mim(*args, cwd: Path = ROOT, timeout: int = 60) -> subprocess.CompletedProcess:
    mim = Path(sys.executable).parent / 'mim'
    assert mim.is_file(), f'{mim} missing: openmim is installed by tools/bootstrap.sh'
    return subprocess.run([str(mim), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_mim_search_lists_every_config():
    proc = _mim('search', 'visattn_mm', '--valid-config')
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    configs = {p.stem for p in (ROOT / 'configs').rglob('*.py') if '_base_' not in p.parts}
    listed = set(proc.stdout.split('[', 1)[1].split(']', 1)[0].replace("'", '').split(', '))
    assert listed == configs


def test_mim_train_finds_the_config_by_name_and_runs_the_package_train_script(tmp_path):
    from visattn_mm import toy_data as toy

    toy.make_coco_instances(tmp_path / 'data' / 'toy_coco', num_train=2, num_val=1)
    work_dir = tmp_path / 'work'
    proc = _mim(
        'train',
        'visattn_mm',
        'maskrcnn_vil_t_toy.py',
        '--work-dir',
        str(work_dir),
        '--cfg-options',
        'train_cfg.max_iters=1',
        'train_dataloader.batch_size=1',
        'train_dataloader.num_workers=0',
        'train_dataloader.persistent_workers=False',
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert 'configs/demo/maskrcnn_vil_t_toy.py' in proc.stdout
    assert (work_dir / 'iter_1.pth').is_file()
