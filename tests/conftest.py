"""The ``cuda`` marker: tests that need a CUDA GPU, skipped with the reason where there is none.

Run them on a GPU machine with ``bash tools/run_tests.sh -m cuda``.
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
