"""tests/conftest.py's ``cuda`` marker on a machine that claims a GPU (emulated on the CPU): a CUDA test
that fails and leaves the device unusable makes the process's later CUDA tests skip, naming it; a test
that fails with the device still usable changes nothing."""

from pathlib import Path

import torch

pytest_plugins = ['pytester']

CONFTEST = (Path(__file__).parent / 'conftest.py').read_text()
TESTS = '''
import pytest

@pytest.mark.cuda
def test_a_meets_an_error():
    raise RuntimeError('CUDA error: an illegal memory access was encountered')

@pytest.mark.cuda
def test_b_runs_after_it():
    pass

def test_c_needs_no_gpu():
    pass
'''


def _run(pytester, monkeypatch, device_usable):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)

    def synchronize():
        if not device_usable:
            raise RuntimeError('CUDA error: an illegal memory access was encountered')

    monkeypatch.setattr(torch.cuda, 'synchronize', synchronize)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_probe=TESTS)
    return pytester.runpytest_inprocess('-p', 'no:cacheprovider', '-rs')


def test_a_broken_device_skips_the_later_cuda_tests(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, device_usable=False)
    result.assert_outcomes(failed=1, skipped=1, passed=1)
    result.stdout.fnmatch_lines(['*the CUDA context of this process broke in test_probe.py::test_a_meets_an_error*'])


def test_a_usable_device_keeps_them(pytester, monkeypatch):
    _run(pytester, monkeypatch, device_usable=True).assert_outcomes(failed=1, passed=2)
