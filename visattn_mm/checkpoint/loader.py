"""Every checkpoint load in one straight line: read -> unwrap -> adapt -> match -> load and report.

:func:`load_checkpoint` runs the stages below for a model under a policy (:mod:`.policy`: the
rules of ``init_cfg``, ``load_from``, evaluation and ``--resume``), which it consults twice, once
to choose and once to judge the finished report:

1. read: a path through :func:`~.formats.read_checkpoint` (an object already read passes as is);
2. unwrap: the tensors in their container (:func:`~.formats.find_state_dict`: ``net``,
   ``model``, ``state_dict``, ...; ``module.`` stripped); a file without them is refused;
3. the policy **chooses** a :class:`LoadPlan`: the module that takes the tensors (the model, or
   a whole model's backbone for backbone-only weights given to ``load_from``) and whether they
   are backbone weights to convert;
4. adapt (:func:`adapt`): backbone weights lose their ``backbone.`` prefix and go through the
   target's ``checkpoint_filter`` (official layout -> ours); then every
   :class:`~.protocol.CheckpointProtocol` module renames, drops derived tensors and resizes its
   tables (what its load pre-hook does on every other load, so each table is resized once);
5. match (:func:`match`): the tensors whose names and shapes fit; the report is complete;
6. the policy **judges** the report: a refusal (nothing is loaded) or a go, with a warning to
   log where it has one;
7. load all or nothing (NaN/inf refused), log the report.

:func:`fit` (stages 4 and 5) is also what a policy asks when it tells what a refused file holds
(would this backbone take it?).
"""

from dataclasses import dataclass, field

import torch
from mmengine.logging import MMLogger

from .formats import CheckpointError, backbone_tensors, find_state_dict, read_checkpoint
from .protocol import CheckpointProtocol

#: The source named in messages for a checkpoint given as an object rather than a file.
OBJECT_SOURCE = '<checkpoint given as an object, not a file>'


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


@dataclass
class Unwrapped:
    """A checkpoint read and unwrapped: what a policy chooses and judges by.

    Attributes:
        checkpoint (dict): The checkpoint as read (training state besides the tensors).
        state_dict (dict): Its tensors as saved, ``module.`` prefixes stripped.
        container (str): Where they were found (``'net'``, ``'model'``, ``'state_dict'``, ``'module'``, ``'bare'``).
        source (str): The file's name, for the messages.
    """

    checkpoint: object
    state_dict: dict
    container: str
    source: str


@dataclass
class LoadPlan:
    """What a policy chose for a checkpoint: the module that takes it and how its tensors get there.

    Attributes:
        target (nn.Module): The module loaded into.
        convert (bool): The tensors are backbone (or classifier) weights: the ``backbone.`` ones
            where there are such keys, without the prefix, converted by the target's
            ``checkpoint_filter``, as ``init_cfg`` loads them. False: matched under the target's
            own names.
        layout (str): The report's layout (a ``checkpoint_filter`` names the one it converted).
        advice (str): The likely cause and the fix, for a policy that refuses a partial match.
    """

    target: object
    convert: bool
    layout: str
    advice: str = ''


def load_checkpoint(model, checkpoint, policy, source=None, map_location='cpu', logger=None):
    """Load ``checkpoint`` into ``model`` (or the part of it ``policy`` chooses), or refuse it.

    Args:
        model (nn.Module): The model given the checkpoint.
        checkpoint (str | dict): File path, or a checkpoint object already read.
        policy: The rules (:mod:`.policy`): ``unwrap_hint`` (appended to the refusal of a file
            without tensors), ``choose(model, unwrapped)`` returning a :class:`LoadPlan`, and
            ``judge(plan, report, unwrapped)`` raising :class:`CheckpointError` to refuse, else
            returning a warning to log after the load, or None.
        source (str, optional): The file's name in messages. Default: ``checkpoint`` if it is a path.
        map_location (str): Passed to ``torch.load``.
        logger (MMLogger, optional): Where the report goes. Default: mmengine's current logger.

    Returns:
        LoadReport: What was loaded.

    Raises:
        CheckpointError: The file cannot be read or holds no state_dict, the policy refuses the
            report, or a tensor to load holds NaN or inf. Nothing is loaded then.
    """
    if source is None:
        source = checkpoint if isinstance(checkpoint, str) else OBJECT_SOURCE
    if isinstance(checkpoint, str):
        checkpoint = read_checkpoint(checkpoint, map_location)
    unwrapped = unwrap(checkpoint, source, policy.unwrap_hint)
    plan = policy.choose(model, unwrapped)
    report, usable = fit(plan, unwrapped)
    warning = policy.judge(plan, report, unwrapped)
    check_finite(usable, report.source)
    _load_all_or_nothing(plan.target, usable)
    log = logger or MMLogger.get_current_instance()
    log.info(report.summary())
    if warning:
        log.warning(warning)
    return report


def unwrap(checkpoint, source, hint):
    """``checkpoint``'s tensors and container as an :class:`Unwrapped`.

    Args:
        checkpoint (dict): The checkpoint as read.
        source (str): The file's name, for the messages.
        hint (str): The policy's question to the user, ending the refusal of a file without tensors.

    Raises:
        CheckpointError: If it holds no state_dict of tensors; the message ends with ``hint``.
    """
    try:
        state_dict, container = find_state_dict(checkpoint)
    except ValueError as err:
        raise CheckpointError(f'{source}: {err}. {hint}') from None
    return Unwrapped(checkpoint, state_dict, container, source)


def fit(plan, unwrapped):
    """Adapt and match: ``(report, usable)``, the complete report and the tensors that fit ``plan.target``.

    Loads nothing.

    Args:
        plan (LoadPlan): The target and whether the tensors are backbone weights to convert.
        unwrapped (Unwrapped): The checkpoint's tensors and container.

    Raises:
        ValueError: From a ``checkpoint_filter`` or a resize that cannot mean what it would do.
    """
    state_dict, container = unwrapped.state_dict, unwrapped.container
    if plan.convert:
        state_dict, container = backbone_tensors(state_dict, container)
    report = LoadReport(source=str(unwrapped.source), container=container, layout=plan.layout)
    return report, match(plan.target, adapt(plan.target, state_dict, report, plan.convert), report)


def adapt(model, state_dict, report, convert):
    """``state_dict`` in ``model``'s layout, with ``report`` noting what changed.

    With ``convert``, ``model``'s ``checkpoint_filter`` first converts an official layout (where
    ``model`` is a :class:`~.protocol.CheckpointProtocol`). Then every such module of ``model``
    renames, drops derived tensors and resizes tables of another size
    (:meth:`~.protocol.CheckpointProtocol.adapt_state_dict`).

    Args:
        model (nn.Module): The module the tensors are for.
        state_dict (dict): Checkpoint tensors, unwrapped; not changed.
        report (LoadReport): Notes the layout and what was converted, renamed, dropped or resized.
        convert (bool): Run ``model``'s ``checkpoint_filter``.

    Returns:
        dict: The tensors under ``model``'s names.
    """
    if convert and isinstance(model, CheckpointProtocol):
        state_dict = model.checkpoint_filter(state_dict, set(model.state_dict()), report)
    state_dict = dict(state_dict)
    for name, module in model.named_modules():
        if isinstance(module, CheckpointProtocol):
            module.adapt_state_dict(state_dict, f'{name}.' if name else '', report)
    return state_dict


def match(model, state_dict, report):
    """The tensors of ``state_dict`` that fit ``model`` (its key, its shape), with ``report`` completed.

    ``report.missing`` lists every tensor of ``model`` that the result does not set (apart from
    ``report.fresh``).

    Args:
        model (nn.Module): The model the tensors are for.
        state_dict (dict): Checkpoint tensors in ``model``'s layout (:func:`adapt`).
        report (LoadReport): Filled in; ``converted`` and ``fresh`` may be set already.

    Returns:
        dict: The usable tensors, by ``model``'s keys.
    """
    target = model.state_dict()
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
