"""The ``cuda`` marker: tests that need a CUDA GPU, skipped with the reason where there is none.

Run them on a GPU machine with ``bash tools/run_tests.sh -m cuda``. A CUDA error such as an illegal
address sticks to the process that met it: once a failed CUDA test leaves the device unusable, the
process's later CUDA tests are skipped, naming that test, instead of failing on its error.
"""

import pytest
import torch

NO_GPU_REASON = (
    'needs a CUDA GPU (torch.cuda.is_available() is False here); run `bash tools/run_tests.sh -m cuda` on a GPU machine'
)


def pytest_configure(config):
    config.addinivalue_line(
        'markers', f'cuda: {NO_GPU_REASON.split(";")[0]}; select with -m cuda, leave out with -m "not cuda"'
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU_REASON)
    for item in items:
        if item.get_closest_marker('cuda') is not None:
            item.add_marker(skip)


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
