"""Bad checkpoints: a clear error naming the file, what was detected and the fix; nothing half-loaded."""

import os
import pickle

import pytest
import torch
from mmdet.registry import MODELS

from helpers import PALE_TINY_ARCH, VIL_TINY_ARCH, assert_unchanged, snapshot
from visattn_mm.checkpoint import load_pretrained
from visattn_mm.models import PaleTransformer, ViL


@pytest.fixture(scope='module')
def model():
    torch.manual_seed(0)
    return ViL(arch=VIL_TINY_ARCH)


@pytest.fixture(scope='module')
def good_file(tmp_path_factory):
    """A valid checkpoint of another ViL with the same arch (different random weights)."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp('ckpt') / 'good.pth'
    torch.save({'state_dict': ViL(arch=VIL_TINY_ARCH).state_dict()}, path)
    return path


def _write_bad(kind, good_file, directory):
    """Write one kind of bad checkpoint; return its path."""
    path = directory / f'{kind}.pth'
    if kind == 'truncated':
        path.write_bytes(good_file.read_bytes()[: len(good_file.read_bytes()) // 2])
    elif kind == 'text':
        path.write_text('model = dict(type="ViL")\n')
    elif kind == 'random_bytes':
        path.write_bytes(
            torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
            .numpy()
            .tobytes()
        )
    elif kind == 'pickled_list':
        torch.save([torch.zeros(3), 1, 'a'], path)
    elif kind == 'plain_pickle':
        with open(path, 'wb') as f:
            pickle.dump({'weights': [1.0, 2.0]}, f)
    elif kind == 'no_tensors':
        torch.save({'epoch': 3, 'meta': {'lr': 0.1}}, path)
    elif kind == 'empty':
        path.write_bytes(b'')
    return path


@pytest.mark.parametrize(
    'kind,detected',
    [
        ('truncated', 'truncated'),
        ('text', 'not a torch pickle|another format'),
        ('random_bytes', 'not a torch pickle'),
        ('pickled_list', "no state_dict of tensors found .* found list"),
        ('plain_pickle', 'not a torch pickle'),
        ('no_tensors', r"no state_dict of tensors found .*\['epoch', 'meta'\]"),
        ('empty', r'the file is empty \(0 bytes'),
    ],
)
def test_file_that_is_not_a_checkpoint(model, good_file, tmp_path, kind, detected):
    path = _write_bad(kind, good_file, tmp_path)
    before = snapshot(model)
    with pytest.raises(ValueError, match=detected) as err:
        load_pretrained(model, str(path))
    message = str(err.value)
    assert str(path) in message
    assert 'tools/convert_ckpt.py' in message  # the fix
    assert_unchanged(model, before)


@pytest.mark.parametrize('value', [float('nan'), float('inf'), float('-inf')])
def test_non_finite_values_are_refused(model, tmp_path, value):
    torch.manual_seed(2)
    state_dict = ViL(arch=VIL_TINY_ARCH).state_dict()
    key = 'stages.2.blocks.0.mlp.fc1.weight'
    state_dict[key][3, 1] = value
    path = tmp_path / 'diverged.pth'
    torch.save(state_dict, path)
    before = snapshot(model)
    with pytest.raises(ValueError, match=r'1 tensor\(s\) hold NaN or inf') as err:
        load_pretrained(model, str(path))
    assert str(path) in str(err.value) and key in str(err.value) and 'earlier checkpoint' in str(err.value)
    assert_unchanged(model, before)


def test_control_the_good_file_loads_and_changes_the_model(good_file):
    """Without this, the 'unchanged' checks above could pass on a loader that never loads."""
    target = ViL(arch=VIL_TINY_ARCH)
    before = snapshot(target)
    report = load_pretrained(target, str(good_file))
    assert report.missing == [] and report.unexpected == []
    expected = torch.load(good_file, weights_only=True)['state_dict']
    for key, value in target.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert any(not torch.equal(v, before[k]) for k, v in target.state_dict().items() if v.is_floating_point())


def test_wrong_model_is_refused_and_nothing_loads(model, tmp_path):
    path = tmp_path / 'pale.pth'
    torch.save({'state_dict': PaleTransformer(arch=PALE_TINY_ARCH).state_dict()}, path)
    before = snapshot(model)
    with pytest.raises(ValueError, match='refusing to load: only 0 of .* match') as err:
        load_pretrained(model, str(path))
    assert str(path) in str(err.value) and 'allow_partial' in str(err.value)
    assert_unchanged(model, before)


def test_failure_half_way_through_load_state_dict_restores_everything(good_file):
    """A module that fails while loading, after earlier modules were copied: all is rolled back."""
    target = ViL(arch=VIL_TINY_ARCH)

    def fail(*args, **kwargs):
        raise RuntimeError('simulated failure in the last stage')

    target.stages[3]._register_load_state_dict_pre_hook(fail)
    before = snapshot(target)
    with pytest.raises(RuntimeError, match='simulated'):
        load_pretrained(target, str(good_file))
    assert_unchanged(target, before)


@pytest.mark.parametrize('route', ['class', 'mmdet_registry'])
def test_missing_file_from_init_cfg_names_the_path_and_how_to_get_it(tmp_path, route):
    missing = os.path.join('checkpoints', 'vil_small_does_not_exist.pth')
    init_cfg = dict(type='Pretrained', checkpoint=missing)
    if route == 'class':
        target = ViL(arch=VIL_TINY_ARCH, init_cfg=init_cfg)
    else:
        target = MODELS.build(dict(type='ViL', arch=VIL_TINY_ARCH, init_cfg=init_cfg))
    before = snapshot(target)
    with pytest.raises(FileNotFoundError) as err:
        target.init_weights()
    message = str(err.value)
    for needed in (repr(missing), 'tools/convert_ckpt.py', 'timm', 'model.backbone.init_cfg=None'):
        assert needed in message, needed
    assert_unchanged(target, before)
