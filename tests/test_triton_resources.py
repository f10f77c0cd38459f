"""tools/analysis/triton_resources.py: every Triton kernel of a backbone's training step, compiled for sm_90
(no GPU), with the registers and spills ptxas reports; and the bounds the launch settings keep them in."""
import importlib.util
import sys
from pathlib import Path

import pytest
from triton_harness import skip_unless_compiled

TOOL = Path(__file__).resolve().parents[1] / 'tools' / 'analysis' / 'triton_resources.py'
# Spill stores (bytes per thread) the launch settings keep each kernel within, by input dtype: bf16 trains on
# tensor cores with next to no spills; fp32 products on CUDA cores hold more registers (the key-side
# backward kernels spilled up to 8 KB per thread before the settings were chosen).
MAX_SPILL = dict(bf16=64, fp32=2560)
KERNELS = {
    'vil-s': {'_sliding_chunk_forward', '_sliding_chunk_backward_queries', '_sliding_chunk_backward_keys'},
    'vil-ls-s': {'_long_short_forward', '_long_short_backward_queries', '_long_short_backward_keys',
                 '_sliding_chunk_forward', '_sliding_chunk_backward_queries', '_sliding_chunk_backward_keys'},
    'pale-t': {'_pale_forward', '_pale_backward_queries', '_pale_backward_keys'},
    'vvt-s': {'_vicinity_sums', '_vicinity_forward', '_vicinity_backward_queries', '_vicinity_backward_keys'},
}


@pytest.fixture(scope='module')
def tool():
    skip_unless_compiled()
    spec = importlib.util.spec_from_file_location('_visattn_triton_resources', TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def rows(tool):
    return tool.main([])


def test_every_kernel_of_every_backbone_is_compiled_and_reported(rows):
    for model, kernels in KERNELS.items():
        for dtype in MAX_SPILL:
            found = {row['kernel'] for row in rows if row['model'] == model and row['dtype'] == dtype}
            assert found == kernels, (model, dtype)
    assert all(0 < row['registers'] <= 255 and row['shared_kib'] > 0 for row in rows)


@pytest.mark.parametrize('dtype', MAX_SPILL)
def test_launch_settings_keep_register_spills_small(rows, dtype):
    spilling = [(row['model'], row['kernel'], row['head_dim'], row['spill_stores'])
                for row in rows if row['dtype'] == dtype and row['spill_stores'] > MAX_SPILL[dtype]]
    assert not spilling


def test_bad_options_name_the_choices(tool, capsys):
    with pytest.raises(SystemExit):
        tool.parse_args(['--models', 'vil-x'])
    assert 'vil-x; choose from vil-s' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tool.parse_args(['--size', '256'])
    assert '--size must be HxW' in capsys.readouterr().err
