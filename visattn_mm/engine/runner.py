"""mmengine's Runner with visattn_mm's checkpoint policy on every load."""

from mmengine.model import BaseTTAModel, is_model_wrapper
from mmengine.runner import CheckpointLoader, Runner

from ..checkpoint import load_model_checkpoint, read_checkpoint
from ..checkpoint.policy import PARTIAL_LOAD_OPTION
from ..compat import mmengine_checkpoint_globals

MMENGINE_REVISE_KEYS = [(r'^module.', '')]


class CheckpointPolicyRunner(Runner):
    """``Runner`` whose checkpoint loads go through :func:`visattn_mm.checkpoint.load_model_checkpoint`.

    ``load_from`` while training, the checkpoint of ``tools/test.py`` (and of
    ``runner.val()``/``test()``) and ``--resume`` are read with
    :func:`~visattn_mm.checkpoint.read_checkpoint` (one error naming the file for a
    truncated or empty one) and logged with a load report. ``load_from`` is refused
    below 90% of the model; a checkpoint without tensors for the neck and heads loads
    into the backbone as ``init_cfg`` would load it. Evaluation and resume load
    exactly: every tensor of the model from the checkpoint, or a refusal saying what
    the file holds and what to do. The tools build this Runner; a config selects it
    with ``runner_type = 'CheckpointPolicyRunner'`` (our base configs do, so mmdet's
    and mmseg's own scripts use it too), and ``load_from_allow_partial = True`` lets
    ``load_from`` load, and evaluation use, a partial match.
    """

    _load_purpose = 'test'  # val()/test(); train() and resume() say otherwise
    #: How a partial evaluation is asked for, in refusals; a tool with its own flag names it instead.
    partial_load_option = PARTIAL_LOAD_OPTION

    def train(self):
        self._load_purpose = 'load_from'
        return super().train()

    def resume(self, filename, *args, **kwargs):
        previous, self._load_purpose = self._load_purpose, 'resume'
        try:
            return super().resume(filename, *args, **kwargs)
        finally:
            self._load_purpose = previous

    def load_checkpoint(self, filename, map_location='cpu', strict=False, revise_keys=MMENGINE_REVISE_KEYS):
        """Read ``filename``, run the ``after_load_checkpoint`` hooks, load it under the policy.

        Args:
            filename (str): A local file, or a URL / ``scheme://`` name that mmengine reads.
            map_location (str | callable): Passed to ``torch.load``.
            strict (bool): True keeps mmengine's own loading (stricter: any difference fails).
            revise_keys (list): Other than mmengine's default (strip ``module.``, which the
                policy does too), mmengine's own loading is kept.

        Returns:
            dict: The checkpoint, as mmengine's ``load_checkpoint`` returns it.

        Raises:
            CheckpointError: The file is unreadable or refused (see the policy).
        """
        if strict or revise_keys != MMENGINE_REVISE_KEYS:
            return super().load_checkpoint(filename, map_location, strict, revise_keys)
        filename = str(filename)
        if '://' in filename:
            with mmengine_checkpoint_globals():
                checkpoint = CheckpointLoader.load_checkpoint(filename, map_location, logger=self.logger)
        else:
            checkpoint = read_checkpoint(filename, map_location)
        self.call_hook('after_load_checkpoint', checkpoint=checkpoint)
        model = self.model
        while is_model_wrapper(model) or isinstance(model, BaseTTAModel):  # as mmengine unwraps them
            model = model.module
        load_model_checkpoint(
            model,
            checkpoint,
            filename,
            self._load_purpose,
            allow_partial=self.cfg.get('load_from_allow_partial', False),
            logger=self.logger,
            partial_option=self.partial_load_option,
        )
        self._has_loaded = True
        self.logger.info(f'Load checkpoint from {filename}')
        return checkpoint
