"""RandomShiftHook in a real mmengine Runner: the switch point, and resume on both sides of it."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from mmengine.hooks import Hook
from mmengine.model import BaseModel
from mmengine.runner import Runner
from torch.utils.data import DataLoader, Dataset

import visattn_mm  # noqa: F401  (registers the hook)
from visattn_mm.compat import mmengine_checkpoint_globals
from visattn_mm.models import SlidingChunkAttention, ViL

TINY_ARCH = dict(depths=(1, 1, 1, 1), embed_dims=(8, 8, 8, 8), num_heads=(1, 1, 1, 1))


class ToyImages(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        image = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(index))
        # A random brightness change from numpy's global generator, as data pipelines use.
        return dict(inputs=image * float(np.random.uniform(0.5, 1.5)))


class ToyModel(BaseModel):
    def __init__(self, drop_path_rate=0.0):
        super().__init__()
        self.backbone = ViL(arch=TINY_ARCH, window_size=2, drop_path_rate=drop_path_rate)
        self.head = nn.Linear(8, 1)

    def forward(self, inputs, data_samples=None, mode='tensor'):
        out = self.head(self.backbone(inputs)[-1].mean(dim=(2, 3)))
        return dict(loss=out.pow(2).mean()) if mode == 'loss' else out


class RecordShift(Hook):
    """Runs after RandomShiftHook (lower priority) and records the state each step."""

    priority = 'LOW'

    def __init__(self):
        self.states = {}

        self.losses = {}

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        layers = [m for m in runner.model.modules() if isinstance(m, SlidingChunkAttention)]
        assert len({m.random_shift for m in layers}) == 1
        self.states[runner.iter] = layers[0].random_shift

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self.losses[runner.iter] = float(outputs['loss'])


def make_runner(work_dir, record, by_epoch, resume_from=None, drop_path_rate=0.0):
    loop = dict(type='EpochBasedTrainLoop', max_epochs=4) if by_epoch else dict(type='IterBasedTrainLoop', max_iters=8)
    return Runner(
        model=ToyModel(drop_path_rate),
        work_dir=str(work_dir),
        train_dataloader=DataLoader(ToyImages(), batch_size=2, shuffle=False),  # 2 iters per epoch
        train_cfg=loop,
        optim_wrapper=dict(optimizer=dict(type='SGD', lr=0.01)),
        default_hooks=dict(checkpoint=dict(type='CheckpointHook', interval=1 if by_epoch else 2, by_epoch=by_epoch)),
        custom_hooks=[dict(type='RandomShiftHook', switch_ratio=0.5), record],
        resume=resume_from is not None,
        load_from=resume_from,
        randomness=dict(seed=0, deterministic=True),
        default_scope='mmengine',
        experiment_name=f'exp{id(record)}',
    )


def train(runner):
    """``runner.train()``: mmengine's plain Runner reads checkpoints with torch's weights-only default, which
    needs mmengine's own globals allowed (our configs' CheckpointPolicyRunner allows them for its reads)."""
    with mmengine_checkpoint_globals():
        runner.train()


@pytest.mark.parametrize('by_epoch', [False, True])
def test_switch_point_and_resume_on_both_sides(tmp_path, by_epoch):
    record = RecordShift()
    train(make_runner(tmp_path, record, by_epoch))
    # 8 iterations in both set-ups (4 epochs x 2 iterations); switch at 50%.
    assert record.states == {i: i < 4 for i in range(8)}

    name = 'epoch_{}.pth' if by_epoch else 'iter_{}.pth'
    for resume_at, saved in ((1 if by_epoch else 2, 2), (3 if by_epoch else 6, 6)):
        resumed = RecordShift()
        train(make_runner(tmp_path, resumed, by_epoch, str(tmp_path / name.format(resume_at))))
        assert resumed.states == {i: i < 4 for i in range(saved, 8)}


@pytest.mark.parametrize('by_epoch', [False, True])
def test_resume_continues_with_exactly_the_same_losses(tmp_path, by_epoch):
    """Resume while random shift is on, with drop path and numpy-random data: the hook's saved
    RNG states make every loss after the resume point equal to the uninterrupted run's."""
    full = RecordShift()
    train(make_runner(tmp_path, full, by_epoch, drop_path_rate=0.2))
    name = 'epoch_1.pth' if by_epoch else 'iter_2.pth'  # both after iteration 2, before the switch
    with mmengine_checkpoint_globals():  # a Runner checkpoint: numpy and HistoryBuffer inside
        checkpoint = torch.load(tmp_path / name, weights_only=True)
    assert len(checkpoint['rng_states']) == 1  # one process

    resumed = RecordShift()
    train(make_runner(tmp_path, resumed, by_epoch, str(tmp_path / name), drop_path_rate=0.2))
    assert sorted(resumed.losses) == list(range(2, 8))
    assert all(resumed.losses[step] == full.losses[step] for step in range(2, 8)), (resumed.losses, full.losses)

    # Control: the same checkpoint without the RNG states continues differently.
    del checkpoint['rng_states']
    torch.save(checkpoint, tmp_path / 'no_rng.pth')
    unseeded = RecordShift()
    train(make_runner(tmp_path, unseeded, by_epoch, str(tmp_path / 'no_rng.pth'), drop_path_rate=0.2))
    assert any(unseeded.losses[step] != full.losses[step] for step in range(2, 8))


def test_eval_mode_ignores_random_shift():
    model = ToyModel()
    from visattn_mm.models import set_random_shift

    set_random_shift(model, True)
    model.eval()
    attn = model.backbone.stages[0].blocks[0].attn
    assert attn.resolve_shift_mode() == 0


def test_switch_ratio_is_validated():
    with pytest.raises(ValueError, match='switch_ratio'):
        visattn_mm.RandomShiftHook(switch_ratio=1.5)
