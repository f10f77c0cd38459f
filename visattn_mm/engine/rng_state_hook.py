"""Exact resume: keep the random number generators' states in checkpoints.

mmengine 0.10.7 checkpoints hold weights, optimizer, schedulers and the
iteration counter, but no RNG state: after a resume the Runner re-seeds from
``randomness.seed``, so dropout, drop path, ViL's random-shift draws and the
data pipeline's random transforms continue from the *initial* stream rather
than from where the interrupted run stopped. :class:`RngStateHook` stores the
states of torch (CPU and every CUDA device), numpy and Python ``random`` in
the checkpoint and puts them back when training continues.

When they are put back matters. An iteration-based loop that resumes at
iteration ``n`` first replays ``n`` batches of the data loader to reach the
same position in the data (in the main process when ``num_workers=0``, which
draws from numpy and ``random`` again), so the states are restored right
before the first batch after that replay is fetched, the moment at which
the interrupted run saved them.

Validation inside training runs right after a checkpoint is saved and draws
random numbers too (a new data-loader iterator takes a seed from torch's
generator), which a resumed run would not replay. The hook therefore makes
validation neutral: the states from before it are put back after it.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from mmengine.dist import all_gather_object, get_rank, get_world_size
from mmengine.hooks import Hook
from mmengine.runner import IterBasedTrainLoop

CHECKPOINT_KEY = 'rng_states'


def capture_rng_state() -> dict:
    """The current states of all random number generators training uses.

    Only plain Python types and tensors, so that ``torch.load`` with
    ``weights_only=True`` reads them back.
    """
    numpy_state = np.random.get_state(legacy=False)
    numpy_state['state']['key'] = numpy_state['state']['key'].tolist()
    return dict(
        torch=torch.get_rng_state(),
        cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        numpy=numpy_state,
        python=random.getstate(),
    )


def restore_rng_state(state: dict) -> None:
    """Put back states returned by :func:`capture_rng_state`.

    Raises:
        ValueError: If the state holds CUDA generators for another number of
            devices than this process sees.
    """
    cuda_states = state['cuda']
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_states and len(cuda_states) != visible:
        raise ValueError(
            f'RngStateHook: the checkpoint holds the RNG states of {len(cuda_states)} CUDA '
            f'devices but this process sees {visible}; resume with the same devices for an '
            'exact continuation, or remove the hook to resume without the saved RNG states.'
        )
    torch.set_rng_state(state['torch'])
    if cuda_states:
        torch.cuda.set_rng_state_all(cuda_states)
    numpy_state = dict(state['numpy'])
    numpy_state['state'] = dict(numpy_state['state'], key=np.asarray(numpy_state['state']['key'], dtype=np.uint32))
    np.random.set_state(numpy_state)
    # pickle turns the inner tuple into a list; random.setstate wants a tuple.
    version, internal, gauss = state['python']
    random.setstate((version, tuple(internal), gauss))


class _RestoreBeforeFetch:
    """Wraps a data iterator; restores RNG states before fetch number ``skip + 1``."""

    def __init__(self, iterator, skip, state):
        self.iterator = iterator
        self.remaining_skips = skip
        self.state = state

    def __iter__(self):
        return self

    def __next__(self):
        if self.state is not None and self.remaining_skips == 0:
            restore_rng_state(self.state)
            self.state = None
        self.remaining_skips -= 1
        return next(self.iterator)


class RngStateHook(Hook):
    """Save the RNG states with every checkpoint and restore them on resume.

    With it, a resumed run draws the same random numbers as the run it
    continues (on the same devices and number of processes), so on CPU in
    deterministic mode its losses equal the uninterrupted run's exactly. In a
    distributed run every rank's states are kept (ranks may be seeded
    differently, ``randomness.diff_rank_seed``). Validation during training
    leaves the states as it found them. A checkpoint loaded without resuming
    (``load_from`` alone: evaluation with ``tools/test.py``, fine-tuning) keeps
    the fresh seed; its RNG states, or their absence, go unmentioned.

    :class:`~visattn_mm.engine.RandomShiftHook` includes this behaviour; a
    config with it needs no extra entry.
    """

    priority = 'NORMAL'

    def __init__(self):
        self._loaded = None
        self._before_val = None
        self._all_ranks = None

    def _gather_if_distributed(self):
        # Only rank 0 saves checkpoints (and calls before_save_checkpoint), so
        # the ranks' states are collected earlier, at points every rank
        # reaches right before CheckpointHook (priority VERY_LOW) may save:
        # one small collective per iteration, in distributed runs only.
        if get_world_size() > 1:
            self._all_ranks = all_gather_object(capture_rng_state())

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        self._gather_if_distributed()

    def after_train_epoch(self, runner):
        self._gather_if_distributed()

    def before_save_checkpoint(self, runner, checkpoint):
        if get_world_size() > 1:
            checkpoint[CHECKPOINT_KEY] = self._all_ranks
        else:
            checkpoint[CHECKPOINT_KEY] = [capture_rng_state()]

    def after_load_checkpoint(self, runner, checkpoint):
        # A resume and `load_from` alone (tools/test.py, fine-tuning) both land here.
        # Only a resume uses the states; which one it is shows in before_train_epoch,
        # once the Runner has set the resumed progress, so nothing is said here.
        self._loaded = dict(states=checkpoint.get(CHECKPOINT_KEY))

    def _resumed_states(self, runner):
        """This rank's states of the checkpoint a resume started from; None if there was none."""
        loaded, self._loaded = self._loaded, None
        if loaded is None or (runner.iter == 0 and runner.epoch == 0):
            return None  # no checkpoint, or `load_from`: a new run keeps the fresh seed
        states = loaded['states']
        if states is None:
            runner.logger.warning(
                'RngStateHook: the checkpoint has no RNG states (saved without this hook); '
                'random draws after the resume start from the seed'
            )
            return None
        if len(states) != get_world_size():
            raise ValueError(
                f'RngStateHook: the checkpoint holds the RNG states of {len(states)} '
                f'processes but this run has {get_world_size()}; resume with as many '
                'processes for an exact continuation, or remove the hook.'
            )
        return states[get_rank()]

    def before_train_epoch(self, runner):
        state = self._resumed_states(runner)
        if state is None:
            return
        loop = runner.train_loop
        if isinstance(loop, IterBasedTrainLoop):
            # The loop replays `runner.iter` batches after this hook, then fetches.
            loop.dataloader_iterator = _RestoreBeforeFetch(loop.dataloader_iterator, runner.iter, state)
        else:
            restore_rng_state(state)

    def before_val_epoch(self, runner):
        self._before_val = capture_rng_state()

    def after_val_epoch(self, runner, metrics=None):
        if self._before_val is not None:
            restore_rng_state(self._before_val)
            self._before_val = None
