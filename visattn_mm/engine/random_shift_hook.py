"""Random-shift training for ViL (paper appendix D), as an mmengine hook."""

from mmengine.runner import EpochBasedTrainLoop

from ..models.vil import set_random_shift
from .rng_state_hook import RngStateHook


class RandomShiftHook(RngStateHook):
    """Train ViL with random shift, then switch to the full neighbourhood.

    While training progress is below ``switch_ratio``, every sliding-chunk
    attention layer draws one random neighbour chunk (1..8) per forward pass;
    from ``switch_ratio`` on, all layers use all 8 neighbours ("mode 0"), which
    acts as fine-tuning. Evaluation always uses mode 0.

    The state is derived from the runner's progress before every epoch or
    iteration, so it is right after a resume from a checkpoint taken on either
    side of the switch. The draws come from torch's global generator, whose
    state this hook keeps in checkpoints (it is a
    :class:`~visattn_mm.engine.RngStateHook`), so a resumed run draws what the
    uninterrupted run would have drawn.

    Args:
        switch_ratio (float): Fraction of training after which random shift is
            switched off, in ``[0, 1]``. 0 never turns it on. Default: 0.75.
        by_epoch (bool, optional): Measure progress in epochs (``runner.epoch /
            max_epochs``) or iterations (``runner.iter / max_iters``). Default:
            epochs for an epoch-based train loop, iterations otherwise.
    """

    priority = 'NORMAL'

    def __init__(self, switch_ratio=0.75, by_epoch=None):
        if not 0.0 <= switch_ratio <= 1.0:
            raise ValueError(f'RandomShiftHook: switch_ratio must be in [0, 1], got {switch_ratio}')
        super().__init__()
        self.switch_ratio = switch_ratio
        self.by_epoch = by_epoch
        self.random_shift_on = None

    def _measure_by_epoch(self, runner):
        if self.by_epoch is None:
            return isinstance(runner.train_loop, EpochBasedTrainLoop)
        return self.by_epoch

    def switch_point(self, runner):
        """The epoch or iteration at which random shift is switched off."""
        total = runner.max_epochs if self._measure_by_epoch(runner) else runner.max_iters
        return int(round(self.switch_ratio * total))

    def _update(self, runner):
        progress = runner.epoch if self._measure_by_epoch(runner) else runner.iter
        wanted = progress < self.switch_point(runner)
        if wanted == self.random_shift_on:
            return
        count = set_random_shift(runner.model, wanted)
        if count == 0:
            runner.logger.warning(
                'RandomShiftHook: the model has no ViL sliding-chunk attention; the hook does nothing'
            )
        else:
            unit = 'epoch' if self._measure_by_epoch(runner) else 'iter'
            runner.logger.info(
                f'RandomShiftHook: random shift {"on" if wanted else "off (mode 0)"} '
                f'in {count} attention layers at {unit} {progress} '
                f'(switch at {unit} {self.switch_point(runner)})'
            )
        self.random_shift_on = wanted

    def before_train(self, runner):
        self.random_shift_on = None
        self._update(runner)

    def before_train_epoch(self, runner):
        super().before_train_epoch(runner)
        if self._measure_by_epoch(runner):
            self._update(runner)

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        if not self._measure_by_epoch(runner):
            self._update(runner)
