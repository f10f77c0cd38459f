"""Load a pretrained checkpoint into a backbone and say exactly what happened.

The path every ``init_cfg=dict(type='Pretrained', checkpoint=...)`` of our
backbones takes: read (``formats.read_checkpoint``), unwrap, let the model's
``checkpoint_filter`` convert an official layout, resize position tables (the
model's :class:`~.protocol.CheckpointProtocol`, which its load pre-hooks also run, so
``load_from``, resume and plain ``load_state_dict`` resize the same way), drop
tensors whose shapes cannot fit, ``load_state_dict``, report, and refuse a load
that matched too little. Whole-model loads (:mod:`.policy`) share the reading
(:func:`read_pretrained`), the matching (:func:`match_state_dict`), the loading
(:func:`load_matched`) and the report.
"""

from dataclasses import dataclass, field

import torch
from mmengine.logging import MMLogger

from .formats import CheckpointError, read_checkpoint, unwrap_state_dict
from .protocol import CheckpointProtocol

MIN_LOADED_FRACTION = 0.9


@dataclass
class LoadReport:
    """What a checkpoint load did, tensor by tensor."""

    source: str
    container: str = ''
    layout: str = ''
    loaded: list = field(default_factory=list)  # keys loaded unchanged
    converted: dict = field(default_factory=dict)  # new key -> how it was made
    renamed: dict = field(default_factory=dict)  # new key -> old key (an older layout, values unchanged)
    resized: dict = field(default_factory=dict)  # key -> (old shape, new shape)
    dropped: dict = field(default_factory=dict)  # checkpoint key -> why it was not used
    mismatched: dict = field(default_factory=dict)  # key -> (checkpoint shape, model shape)
    fresh: dict = field(default_factory=dict)  # model tensors such checkpoints never have -> why
    missing: list = field(default_factory=list)  # model tensors the checkpoint did not set
    unexpected: list = field(default_factory=list)  # checkpoint tensors the model has no place for
    num_model_params: int = 0
    num_loaded_params: int = 0

    @property
    def loaded_fraction(self):
        return self.num_loaded_params / max(self.num_model_params, 1)

    def summary(self, max_keys=12):
        def by_reason(entries):
            reasons = {}
            for key, reason in entries.items():
                reasons.setdefault(reason, []).append(key)
            return '; '.join(f'{reason}: {len(ks)} ({keys(ks)})' for reason, ks in reasons.items())

        def keys(items, limit=max_keys):
            items = list(items)
            shown = ', '.join(map(str, items[:limit]))
            return shown + (f', ... (+{len(items) - limit})' if len(items) > limit else '')

        # 'new <- old' pairs are long: a few examples keep their lines readable.
        pairs = max(1, max_keys // 4)

        def counted(label, entries, detail):
            """``label: count``, and ``detail`` where there are entries."""
            return f'  {label}: {len(entries)}' + (f' {detail}' if entries else '')

        lines = [
            f'checkpoint {self.source}: container {self.container!r}, layout {self.layout!r}',
            f'  parameter tensors loaded: {self.num_loaded_params}/{self.num_model_params} '
            f'({100 * self.loaded_fraction:.1f}%)',
            f'  loaded as-is: {len(self.loaded)}',
            counted(
                'converted', self.converted, f'({keys((f"{k} <- {v}" for k, v in self.converted.items()), pairs)})'
            ),
            # Only layouts that were renamed say so.
            *(
                [
                    counted(
                        'renamed from an older layout',
                        self.renamed,
                        f'({keys((f"{k} <- {v}" for k, v in self.renamed.items()), pairs)})',
                    )
                ]
                if self.renamed
                else []
            ),
            counted(
                'resized',
                self.resized,
                f'({keys(f"{k} {tuple(a)}->{tuple(b)}" for k, (a, b) in self.resized.items())})',
            ),
            counted('dropped', self.dropped, f'[{by_reason(self.dropped)}]'),
            counted(
                'shape mismatch (not loaded)',
                self.mismatched,
                f'({keys(f"{k} ckpt {tuple(a)} vs model {tuple(b)}" for k, (a, b) in self.mismatched.items())})',
            ),
            counted('initialised fresh', self.fresh, f'[{by_reason(self.fresh)}]'),
            counted('missing', self.missing, f'({keys(self.missing)})'),
            counted('unexpected', self.unexpected, f'({keys(self.unexpected)})'),
        ]
        return '\n'.join(lines)


INIT_CFG_ADVICE = (
    'is it a checkpoint of another model or size? Pass allow_partial=True '
    '(init_cfg=dict(..., allow_partial=True)) to load it anyway.'
)


def load_pretrained(
    model, checkpoint, allow_partial=False, logger=None, map_location='cpu', source=None, advice=INIT_CFG_ADVICE
):
    """Load ``checkpoint`` (a path or an already-read object) into ``model``.

    Args:
        model (nn.Module): A backbone or classifier. If it is a
            :class:`~.protocol.CheckpointProtocol`, its ``checkpoint_filter`` converts
            official layouts first.
        checkpoint (str | dict): File path, or a checkpoint object already read.
        allow_partial (bool): Load even if fewer than 90% of the model's parameter
            tensors are set (e.g. deliberately loading only some stages).
        logger (MMLogger, optional): Where the report goes. Default: mmengine's
            current logger.
        map_location (str): Passed to ``torch.load``.
        source (str, optional): The file's name in messages, for a checkpoint already
            read. Default: ``checkpoint`` if it is a path.
        advice (str): The likely cause and the fix, in the refusal message.

    Returns:
        LoadReport: What was loaded.

    Raises:
        CheckpointNotFoundError: If the file does not exist (the message says how to get it).
        CheckpointError: If the file is not a checkpoint, holds no state_dict, holds NaN
            or inf values, or fewer than 90% of the parameter tensors would be loaded
            and ``allow_partial`` is False. Nothing is loaded then.
    """
    state_dict, report = read_pretrained(model, checkpoint, map_location, source)
    return load_state_dict_with_report(model, state_dict, report, allow_partial, advice, logger)


def read_pretrained(model, checkpoint, map_location='cpu', source=None):
    """Read and unwrap ``checkpoint`` and convert it to ``model``'s layout; load nothing.

    The steps of :func:`load_pretrained` before the matching, shared with the policy,
    which asks whether a file would fit a backbone without loading it.

    Args:
        model (nn.Module): A backbone or classifier (see :func:`load_pretrained`).
        checkpoint (str | dict): File path, or a checkpoint object already read.
        map_location (str): Passed to ``torch.load``.
        source (str, optional): The file's name in messages (see :func:`load_pretrained`).

    Returns:
        tuple: ``(state_dict, report)``: the tensors under ``model``'s names and a
        :class:`LoadReport` noting the container, layout and conversions.

    Raises:
        CheckpointError: If the file cannot be read or holds no state_dict.
    """
    if source is None:
        source = checkpoint if isinstance(checkpoint, str) else '<checkpoint given as an object, not a file>'
    if isinstance(checkpoint, str):
        checkpoint = read_checkpoint(checkpoint, map_location)
    try:
        state_dict, container = unwrap_state_dict(checkpoint)
    except ValueError as err:
        raise CheckpointError(
            f'{source}: {err}. Is it a model checkpoint? Point to a file holding '
            'a state_dict (tools/convert_ckpt.py writes one).'
        ) from None
    report = LoadReport(source=str(source), container=container, layout='ours')
    if isinstance(model, CheckpointProtocol):
        state_dict = model.checkpoint_filter(state_dict, set(model.state_dict()), report)
    return state_dict, report


def load_state_dict_with_report(model, state_dict, report, allow_partial=False, advice=INIT_CFG_ADVICE, logger=None):
    """Load the tensors of ``state_dict`` that fit ``model``, filling in ``report``; or refuse.

    Args:
        model (nn.Module): The model (a backbone, or a whole detector or segmentor).
        state_dict (dict): Checkpoint tensors, already in ``model``'s layout.
        report (LoadReport): Filled in; ``converted`` and ``fresh`` may be set already.
        allow_partial (bool): Load even if fewer than 90% of ``model``'s parameter
            tensors are set.
        advice (str): The likely cause and the fix, in the refusal message.
        logger (MMLogger, optional): Where the report goes. Default: mmengine's current logger.

    Returns:
        LoadReport: ``report``.

    Raises:
        CheckpointError: Below 90% without ``allow_partial``, or for NaN/inf values;
            nothing is loaded then.
    """
    usable = match_state_dict(model, state_dict, report)
    if report.loaded_fraction < MIN_LOADED_FRACTION and not allow_partial:
        raise CheckpointError(
            f'refusing to load: only {report.num_loaded_params} of {report.num_model_params} '
            f'parameter tensors of {type(model).__name__} match {report.source} (need '
            f'{MIN_LOADED_FRACTION:.0%}); {advice} Nothing was loaded.\n' + report.summary()
        )
    return load_matched(model, usable, report, logger)


def match_state_dict(model, state_dict, report):
    """The tensors of ``state_dict`` that fit ``model``, with ``report`` filled in; loads nothing.

    Every :class:`~.protocol.CheckpointProtocol` module of ``model`` first drops its
    derived tensors and resizes its tables (:meth:`~.protocol.CheckpointProtocol.adapt_state_dict`);
    then a tensor fits if ``model`` has its key with the same shape. ``report.missing``
    lists every tensor of ``model`` that the result does not set (apart from ``report.fresh``).

    Args:
        model (nn.Module): The model the tensors are for.
        state_dict (dict): Checkpoint tensors, already in ``model``'s layout.
        report (LoadReport): Filled in; ``converted`` and ``fresh`` may be set already.

    Returns:
        dict: The usable tensors, by ``model``'s keys.
    """
    target = model.state_dict()
    state_dict = dict(state_dict)
    for name, module in model.named_modules():
        if isinstance(module, CheckpointProtocol):
            module.adapt_state_dict(state_dict, f'{name}.' if name else '', report)
    usable = {}
    for key, value in state_dict.items():
        if key not in target:
            report.unexpected.append(key)
        elif value.shape != target[key].shape:
            report.mismatched[key] = (tuple(value.shape), tuple(target[key].shape))
        else:
            if key not in report.converted and key not in report.renamed and key not in report.resized:
                report.loaded.append(key)
            usable[key] = value
    param_names = [name for name, _ in model.named_parameters()]
    report.num_model_params = len(param_names)
    report.num_loaded_params = sum(name in usable for name in param_names)
    report.missing = [k for k in target if k not in usable and k not in report.fresh]
    return usable


def load_matched(model, usable, report, logger=None):
    """Load ``usable`` (from :func:`match_state_dict`) into ``model`` all or nothing and log ``report``.

    Raises:
        CheckpointError: For NaN/inf values; nothing is loaded then.
    """
    check_finite(usable, report.source)
    _load_all_or_nothing(model, usable)
    (logger or MMLogger.get_current_instance()).info(report.summary())
    return report


def check_finite(state_dict, source, max_keys=5):
    """Raise a CheckpointError naming ``source`` and the tensors that hold NaN or inf values."""
    bad = [key for key, value in state_dict.items() if value.is_floating_point() and not torch.isfinite(value).all()]
    if bad:
        shown = ', '.join(bad[:max_keys]) + (f', ... (+{len(bad) - max_keys})' if len(bad) > max_keys else '')
        raise CheckpointError(
            f'refusing to load {source}: {len(bad)} tensor(s) hold NaN or inf values ({shown}). '
            'The run that wrote it probably diverged; use an earlier checkpoint of that run '
            'or retrain. Nothing was loaded.'
        )


def _load_all_or_nothing(model, state_dict):
    """``load_state_dict(strict=False)``, restoring every tensor if it fails half-way.

    ``nn.Module.load_state_dict`` copies tensor by tensor and raises only at the end,
    so a failure could otherwise leave a model half-loaded.
    """
    backup = {k: v.detach().clone() for k, v in model.state_dict().items()}
    try:
        model.load_state_dict(state_dict, strict=False)
    except Exception:
        # Copied back in place, not through load_state_dict, whose hooks may be what failed.
        current = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for key, value in backup.items():
                current[key].copy_(value)
        raise
