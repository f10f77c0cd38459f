"""The ``cuda`` marker, and the order the test files run in.

``cuda``: tests that need a CUDA GPU, skipped with the reason where there is none. Run them on a GPU
machine with ``bash tools/run_tests.sh -m cuda``. A CUDA error such as an illegal address sticks to the
process that met it: once a failed CUDA test leaves the device unusable, the process's later CUDA tests
are skipped, naming that test, instead of failing on its error.

Order: the slowest files first. ``tools/run_tests.sh`` runs each file in one pytest-xdist process, handed
out in collection order; a long file handed out last would run alone at the end.

Deterministic algorithms: a training run with ``randomness=dict(deterministic=True)`` turns on
``torch.use_deterministic_algorithms`` for the whole process (mmengine never turns it off), and the
Triton window ops then take their other backward (``ops.triton.host.bias_grad_parts``); every test
starts and ends with the setting the process began with.
"""

from pathlib import Path

import pytest
import torch

# The slowest test files, slowest first (`bash tools/run_tests.sh --durations=0` shows where the time goes).
SLOWEST_FILES = (
    'test_tools/test_demo.py',
    'test_ops/test_compile.py',
    'test_tools/test_deploy.py',
    'test_ops/test_triton/test_triton_sliding_chunk.py',
    'test_engine/test_random_shift_hook.py',
    'test_ops/test_triton/test_triton_resources.py',
    'test_ops/test_triton/test_triton_long_short.py',
    'test_engine/test_training_reliability.py',
    'test_models/test_block_compile.py',
    'test_tools/test_tools_cli.py',
)
TESTS = Path(__file__).parent

NO_GPU_REASON = (
    'needs a CUDA GPU (torch.cuda.is_available() is False here); run `bash tools/run_tests.sh -m cuda` on a GPU machine'
)


def pytest_configure(config):
    config.addinivalue_line(
        'markers', f'cuda: {NO_GPU_REASON.split(";")[0]}; select with -m cuda, leave out with -m "not cuda"'
    )


def _slowest_first(items):
    stale = [name for name in SLOWEST_FILES if not (TESTS / name).is_file()]
    if stale:
        raise pytest.UsageError(f'tests/conftest.py SLOWEST_FILES names files that do not exist: {stale}')
    rank = {str(TESTS / name): i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))  # stable: the others keep their order


def pytest_collection_modifyitems(config, items):
    if config.rootpath / 'tests' == TESTS:  # this suite, not a copy of this file (tests/test_cuda_marker.py)
        _slowest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if item.get_closest_marker('cuda') is not None:
            item.add_marker(skip)


_DETERMINISTIC_AT_START = (
    torch.are_deterministic_algorithms_enabled(),
    torch.is_deterministic_algorithms_warn_only_enabled(),
)


@pytest.fixture(autouse=True)
def _restore_deterministic_algorithms():
    yield
    enabled, warn_only = _DETERMINISTIC_AT_START
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


# The test after which this process's CUDA context stopped working (at most one).
_cuda_broken_by = []


def _cuda_context_broken():
    try:
        torch.cuda.synchronize()
    except RuntimeError:  # torch.AcceleratorError too
        return True
    return False


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if (
        report.failed
        and report.when == 'call'
        and item.get_closest_marker('cuda') is not None
        and not _cuda_broken_by
        and _cuda_context_broken()
    ):
        _cuda_broken_by.append(item.nodeid)
    return report


def pytest_runtest_setup(item):
    if _cuda_broken_by and item.get_closest_marker('cuda') is not None:
        pytest.skip(f'the CUDA context of this process broke in {_cuda_broken_by[0]} (its error sticks to the process)')
