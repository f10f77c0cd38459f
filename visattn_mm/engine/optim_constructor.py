"""The optimizer-wrapper constructors of our configs: mmengine's default, with plain-dict parameter groups
and a summary of what ``paramwise_cfg`` did instead of a log line per parameter."""

import contextlib
import logging

from mmengine.logging import MMLogger, print_log
from mmengine.optim import DefaultOptimWrapperConstructor

# mmengine's constructor logs one INFO line per parameter and option ("paramwise_options -- name:key=value")
# and one WARNING per frozen parameter; these go to the DEBUG level, the summary says what they add up to.
_PER_PARAMETER_LINE = 'paramwise_options -- '
# mmengine's record of the multipliers behind a group's lr and weight_decay, which the summary shows.
_MULTIPLIER_KEYS = {'lr_mult', 'decay_mult'}
_FROZEN_LINE = ' is skipped since its requires_grad=False'
# More rows than this and the summary merges the rows that differ only in their learning rate.
MAX_SUMMARY_ROWS = 8


class _PerParameterLinesToDebug(logging.Filter):
    """Turns mmengine's per-parameter lines into DEBUG records (shown with ``log_level='DEBUG'``)."""

    def filter(self, record):
        message = record.getMessage()
        if message.startswith(_PER_PARAMETER_LINE) or message.endswith(_FROZEN_LINE):
            record.levelno, record.levelname = logging.DEBUG, 'DEBUG'
        return True


@contextlib.contextmanager
def _per_parameter_lines_at_debug():
    logger = MMLogger.get_current_instance()
    line_filter = _PerParameterLinesToDebug()
    logger.addFilter(line_filter)
    try:
        yield
    finally:
        logger.removeFilter(line_filter)


def _format_value(value):
    return f'{value:g}' if isinstance(value, float) else str(value)


def summarize_param_groups(model, groups):
    """What the parameter groups hold, in a few lines: one per combination of settings, with its tensor and
    value counts and where in the model they are (by top-level module).

    Settings shown: ``lr``, ``weight_decay`` and any other that differs between groups (not mmengine's
    ``lr_mult`` and ``decay_mult``, already applied to the two). With more than
    :data:`MAX_SUMMARY_ROWS` combinations (layer-wise lr decay), rows differing only in ``lr`` are merged
    and show its range.

    Args:
        model (torch.nn.Module): The model the groups were built from.
        groups (list[dict]): The optimizer's ``param_groups``.

    Returns:
        str: The summary, its first line the totals.
    """
    names = {id(param): name for name, param in model.named_parameters()}
    shown = {'lr', 'weight_decay'} & set().union(*groups)
    differing = set().union(*groups) - {'params'} - _MULTIPLIER_KEYS
    shown |= {key for key in differing if len({repr(group.get(key)) for group in groups}) > 1}
    keys = sorted(shown, key=lambda key: (key != 'lr', key != 'weight_decay', key))
    rows = _group_rows(groups, keys)
    if len(rows) > MAX_SUMMARY_ROWS:
        keys = [key for key in keys if key != 'lr']
        rows = _group_rows(groups, keys)
    trained = [param for group in groups for param in group['params']]
    frozen = [param for param in model.parameters() if not param.requires_grad]
    lines = [
        f'optimizer: {len(trained)} parameter tensors ({_millions(trained)} values) in {len(groups)} groups'
        + (f'; {len(frozen)} frozen tensors (requires_grad=False) left out' if frozen else '')
        + ':'
    ]
    for settings, members in rows.items():
        lrs = sorted({group['lr'] for group in members if 'lr' in group})
        params = [param for group in members for param in group['params']]
        where = {}
        for param in params:
            module = names.get(id(param), '?').split('.', 1)[0]
            where[module] = where.get(module, 0) + 1
        described = [f'{key} {_format_value(value)}' for key, value in zip(keys, settings)]
        if 'lr' not in keys and lrs:
            described.insert(
                0, f'lr {_format_value(lrs[0])}' + (f' to {_format_value(lrs[-1])}' if len(lrs) > 1 else '')
            )
        lines.append(
            f'  {", ".join(described)}: {len(params)} tensors ({_millions(params)} values; '
            + ', '.join(f'{module} {count}' for module, count in where.items())
            + ')'
        )
    return '\n'.join(lines)


def _group_rows(groups, keys):
    rows = {}
    for group in groups:
        rows.setdefault(tuple(group.get(key) for key in keys), []).append(group)
    return rows


def _millions(params):
    return f'{sum(param.numel() for param in params) / 1e6:.2f}M'


class PlainGroupsOptimWrapperConstructor(DefaultOptimWrapperConstructor):
    """mmengine's :class:`~mmengine.optim.DefaultOptimWrapperConstructor` (``paramwise_cfg`` and all),
    whose optimizer keeps its parameter groups as plain dicts, and which logs what its rules did in a
    few lines (:func:`summarize_param_groups`) where mmengine's logs a line per parameter (those go to
    the DEBUG level).

    With a ``paramwise_cfg`` the default constructor passes the groups to the optimizer inside a
    ``ConfigDict``, and the optimizer keeps those objects: ``torch.compile`` (mmengine's
    ``compile=True``) cannot trace an optimizer step over them (``InternalTorchDynamoError:
    AttributeError: 'UserDefinedDictVariable' object has no attribute 'items'``). The groups hold
    the same parameters and values either way.
    """

    def __call__(self, model):
        with _per_parameter_lines_at_debug():
            wrapper = super().__call__(model)
        groups = wrapper.optimizer.param_groups
        groups[:] = [dict(group) for group in groups]
        model = getattr(model, 'module', model)  # a distributed wrapper's model
        self.adjust_groups(model, groups)
        print_log(summarize_param_groups(model, groups), logger='current')
        return wrapper

    def adjust_groups(self, model, groups):
        """Change the groups' settings in place before they are summarised; nothing here.

        Args:
            model (torch.nn.Module): The model (not its distributed wrapper).
            groups (list[dict]): The optimizer's ``param_groups``.
        """


class LayerDecayOptimWrapperConstructor(PlainGroupsOptimWrapperConstructor):
    """Layer-wise learning-rate decay, the usual recipe for fine-tuning a transformer backbone: the
    learning rate of a backbone parameter in layer ``d`` of ``n`` is scaled by
    ``layer_decay_rate ** (n - 1 - d)`` (the layers of the backbone's ``get_layer_depth``, as
    mmpretrain defines it; the neck and heads keep the full rate), on top of what the rest of
    ``paramwise_cfg`` does (the no-decay rules of our configs).

    mmdet's and mmseg's own layer-decay constructors recognise their ConvNeXt and BEiT by class name
    and raise ``NotImplementedError`` for any other backbone; mmpretrain's calls ``get_layer_depth``
    as this one does.

    Args:
        optim_wrapper_cfg (dict): As for mmengine's constructor.
        paramwise_cfg (dict): As for mmengine's constructor, plus ``layer_decay_rate`` (float in
            (0, 1]; required).
    """

    def __init__(self, optim_wrapper_cfg, paramwise_cfg=None):
        paramwise_cfg = dict(paramwise_cfg or {})
        rate = paramwise_cfg.pop('layer_decay_rate', None)
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate <= 1:
            raise ValueError(
                f'LayerDecayOptimWrapperConstructor: paramwise_cfg.layer_decay_rate={rate!r} must be a number in '
                '(0, 1], e.g. 0.9'
            )
        # mmengine's constructor gives every parameter a group of its own only with a paramwise_cfg.
        paramwise_cfg.setdefault('bias_decay_mult', 1.0)
        super().__init__(optim_wrapper_cfg, paramwise_cfg)
        self.layer_decay_rate = float(rate)

    def adjust_groups(self, model, groups):
        """Scale each backbone group's learning rate by its layer's decay (see the class).

        Args:
            model (torch.nn.Module): The model (not its distributed wrapper).
            groups (list[dict]): The optimizer's ``param_groups``, one parameter each.

        Raises:
            ValueError: If the model's backbone has no ``get_layer_depth``.
        """
        backbone = getattr(model, 'backbone', None)
        if not hasattr(backbone, 'get_layer_depth'):
            raise ValueError(
                f'LayerDecayOptimWrapperConstructor: the model\'s backbone ({type(backbone).__name__}) has no '
                'get_layer_depth; use it with a visattn_mm backbone'
            )
        names = {id(param): name for name, param in model.named_parameters()}
        for group in groups:
            depth, num_layers = backbone.get_layer_depth(names[id(group['params'][0])], 'backbone.')
            group['lr'] *= self.layer_decay_rate ** (num_layers - 1 - depth)
