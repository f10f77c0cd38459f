"""The rules of every checkpoint load, and its two entry points.

:func:`load_pretrained` (``init_cfg``, the converter, timm's ``pretrained=True``) and
:func:`load_model_checkpoint` (``load_from``, ``tools/test.py``, ``--resume``) each run the one
load path (:func:`.loader.load_checkpoint`) under a policy, which it consults twice: to choose
where the tensors go, and to judge the finished report.

* ``init_cfg`` (:class:`PretrainedPolicy`): the file's backbone weights, converted from an
  official layout, into the model; a refusal when less than 90% of it would be set.
* ``load_from`` (start training from a checkpoint, :class:`WholeModelPolicy`) follows
  ``init_cfg``'s rule: a checkpoint without tensors for this model's neck and heads (ImageNet
  classification weights, or another detector's or segmentor's) loads into ``model.backbone``
  exactly as ``init_cfg`` would load it (official layouts converted, full-attention ``qkv``
  split); any other is matched against the whole model; either is refused below 90%.
* evaluating (``'test'``) and resuming (``'resume'``) load exactly: every tensor of the
  model must come from the checkpoint with its shape, or the file is refused with what
  is missing or of another shape, what the file holds (backbone-only weights, another
  detector or segmentor, another backbone or size, another number of classes) and the
  fix that works for that case. ``allow_partial`` evaluates a partial match on purpose;
  resuming has no such option. Resuming also needs the training state mmengine restores
  (``meta`` with the epoch and iteration, ``message_hub``).
"""

from .formats import CheckpointError
from .loader import LoadPlan, fit, load_checkpoint

MIN_LOADED_FRACTION = 0.9
PURPOSES = ('load_from', 'test', 'resume')

INIT_CFG_ADVICE = (
    'is it a checkpoint of another model or size? Pass allow_partial=True '
    '(init_cfg=dict(..., allow_partial=True)) to load it anyway.'
)
#: How a config asks for a partial load; the tools that have a flag for it say theirs instead.
PARTIAL_LOAD_OPTION = 'set load_from_allow_partial=True in the config (--cfg-options load_from_allow_partial=True)'
INIT_FROM_IMAGENET = (
    "model.backbone.init_cfg=dict(type='Pretrained', checkpoint=FILE) or "
    'load_from=FILE (which loads classification checkpoints into the backbone)'
)
LOAD_FROM_ADVICE = (
    'is it a checkpoint of another model (another backbone, size or detector)? '
    'Use a checkpoint of this config\'s model; to start from ImageNet weights use '
    f'{INIT_FROM_IMAGENET}. To load a partial match on purpose, {PARTIAL_LOAD_OPTION}.'
)
REFUSED_ACTION = {'test': 'evaluate', 'resume': 'resume from'}
#: The keys of a checkpoint that mmengine's ``Runner.resume`` reads unconditionally.
RESUME_STATE = ('meta', 'message_hub')
#: Training state mmengine's checkpoints also hold; resumed only where present.
OPTIONAL_RESUME_STATE = ('optimizer', 'param_schedulers')
#: Top-level names of a classifier's own tensors next to ``backbone.``: such a file is backbone-only.
CLASSIFIER_PARTS = ('head', 'neck')
MAX_LISTED = 4


def load_pretrained(
    model, checkpoint, allow_partial=False, logger=None, map_location='cpu', source=None, advice=INIT_CFG_ADVICE
):
    """Load ``checkpoint`` (a path or an already-read object) into ``model``, as ``init_cfg`` does.

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
    return load_checkpoint(model, checkpoint, PretrainedPolicy(allow_partial, advice), source, map_location, logger)


def load_model_checkpoint(
    model, checkpoint, source, purpose, allow_partial=False, logger=None, partial_option=PARTIAL_LOAD_OPTION
):
    """Load a checkpoint given to the whole model, or refuse it with the reason and the fix.

    Args:
        model (nn.Module): The detector or segmentor (not wrapped in DDP).
        checkpoint (dict): The checkpoint, already read.
        source (str): The file's name, for the messages.
        purpose (str): ``'load_from'`` (start training from it), ``'test'`` (evaluate
            it) or ``'resume'`` (continue the run that wrote it).
        allow_partial (bool): With ``'load_from'``, load even if less than 90% matches;
            with ``'test'``, evaluate with the tensors that match (the others keep their
            initial values). Ignored for ``'resume'``.
        logger (MMLogger, optional): Where the report goes. Default: mmengine's current logger.
        partial_option (str): How the caller's tool asks for a partial evaluation, named
            in the refusal of an inexact ``'test'`` load.

    Returns:
        LoadReport: What was loaded (into ``model.backbone`` for a checkpoint without
        tensors for the other parts, given to ``load_from``).

    Raises:
        ValueError: For another ``purpose``.
        CheckpointError: If the checkpoint holds no state_dict; for ``'load_from'``, if
            it matches less than 90% of the model (of the backbone, for a checkpoint
            without tensors of the other parts); for ``'test'`` (unless ``allow_partial``)
            and ``'resume'``, if any tensor of the model would not come from it; for
            ``'resume'``, if it lacks the training state. Nothing is loaded then.
    """
    policy = WholeModelPolicy(purpose, allow_partial, partial_option)
    return load_checkpoint(model, checkpoint, policy, source, logger=logger)


class PretrainedPolicy:
    """``init_cfg``'s rule: the file's backbone weights, converted, into the model; refused below 90%.

    Args:
        allow_partial (bool): Load even if fewer than 90% of the model's parameter tensors are set.
        advice (str): The likely cause and the fix, in the refusal message.
    """

    unwrap_hint = 'Is it a model checkpoint? Point to a file holding a state_dict (tools/convert_ckpt.py writes one).'

    def __init__(self, allow_partial=False, advice=INIT_CFG_ADVICE):
        self.allow_partial, self.advice = allow_partial, advice

    def choose(self, model, unwrapped):
        """Into ``model`` itself, converted from its official layout.

        Args:
            model (nn.Module): The backbone or classifier given the checkpoint.
            unwrapped (Unwrapped): The checkpoint (not looked at: every file goes the same way).
        """
        return LoadPlan(model, convert=True, layout='ours', advice=self.advice)

    def judge(self, plan, report, unwrapped):
        """Refuse below 90% (unless ``allow_partial``); no warning.

        Args:
            plan (LoadPlan): What :meth:`choose` chose.
            report (LoadReport): The finished report.
            unwrapped (Unwrapped): The checkpoint (not looked at).
        """
        _refuse_below_fraction(plan, report, self.allow_partial)


class WholeModelPolicy:
    """The rules of a checkpoint given to a whole detector or segmentor, by purpose (the module's docstring).

    Args:
        purpose (str): ``'load_from'``, ``'test'`` or ``'resume'`` (see :func:`load_model_checkpoint`).
        allow_partial (bool): See :func:`load_model_checkpoint`.
        partial_option (str): How the caller's tool asks for a partial evaluation.

    Raises:
        ValueError: For another ``purpose``.
    """

    unwrap_hint = 'Is it a model checkpoint?'

    def __init__(self, purpose, allow_partial=False, partial_option=PARTIAL_LOAD_OPTION):
        if purpose not in PURPOSES:
            raise ValueError(f'purpose={purpose!r}; allowed: {PURPOSES}')
        self.purpose, self.allow_partial, self.partial_option = purpose, allow_partial, partial_option

    def choose(self, model, unwrapped):
        """The backbone for a ``load_from`` file without tensors of the other parts; else the whole model.

        Args:
            model (nn.Module): The detector or segmentor.
            unwrapped (Unwrapped): The checkpoint's tensors, by whose top-level names it chooses.
        """
        names = top_level_names(unwrapped.state_dict)
        if self.purpose != 'load_from':
            return LoadPlan(model, convert=False, layout=_whole_model_layout(model, names))
        parts = parts_besides_backbone(model)
        if parts and not set(names) & set(parts):
            advice = _backbone_load_from_advice(unwrapped.source, model, names)
            return LoadPlan(model.backbone, convert=True, layout='ours', advice=advice)
        return LoadPlan(model, convert=False, layout='whole model', advice=LOAD_FROM_ADVICE)

    def judge(self, plan, report, unwrapped):
        """Refuse what the purpose does not take; the warning of a partial evaluation, or None.

        Args:
            plan (LoadPlan): What :meth:`choose` chose.
            report (LoadReport): The finished report.
            unwrapped (Unwrapped): The checkpoint: what a refusal says it holds, and the training
                state ``--resume`` needs.

        Raises:
            CheckpointError: The refusal, with what the file holds and the fix.
        """
        if self.purpose == 'load_from':
            _refuse_below_fraction(plan, report, self.allow_partial)
            return None
        if report.missing and not (self.allow_partial and self.purpose == 'test'):
            raise CheckpointError(_inexact_refusal(plan.target, unwrapped, report, self.purpose, self.partial_option))
        if self.purpose == 'resume':
            # Every tensor of the model matched (nothing is missing), so their count is the model's.
            _check_resume_state(unwrapped.checkpoint, unwrapped.source, len(plan.target.state_dict()))
            _check_no_renames(report, unwrapped.source)
        if not report.missing:
            return None
        return (
            f'evaluating {unwrapped.source} with {len(report.missing)} tensors of {type(plan.target).__name__} '
            f'not from it (load_from_allow_partial): {_grouped(report.missing)}'
        )


def _refuse_below_fraction(plan, report, allow_partial):
    """Refuse a load that sets less than 90% of ``plan.target``'s parameter tensors, unless ``allow_partial``."""
    if report.loaded_fraction < MIN_LOADED_FRACTION and not allow_partial:
        raise CheckpointError(
            f'refusing to load: only {report.num_loaded_params} of {report.num_model_params} '
            f'parameter tensors of {type(plan.target).__name__} match {report.source} (need '
            f'{MIN_LOADED_FRACTION:.0%}); {plan.advice} Nothing was loaded.\n' + report.summary()
        )


def _whole_model_layout(model, names):
    """The report's layout of a file given to a whole model: ``'whole model'`` where its top-level ``names``
    are the model's parts (``backbone``, ``neck``, ...), else what they are (a ResNet-50 ImageNet file:
    ``conv1, bn1, layer1, ...``)."""
    if set(names) & {name for name, _ in model.named_children()}:
        return 'whole model'
    shown = ', '.join(names[:4]) + (', ...' if len(names) > 4 else '')
    return f'not a whole model of this kind (top-level names {shown})'


def parts_besides_backbone(model):
    """Names of ``model``'s top-level modules other than ``backbone`` that hold tensors.

    Empty for a model without a ``backbone``: every checkpoint is then matched whole.
    """
    if not hasattr(model, 'backbone'):
        return []
    return [name for name, child in model.named_children() if name != 'backbone' and len(child.state_dict())]


def top_level_names(state_dict):
    """The first components of the keys of ``state_dict`` (``backbone``, ``neck``, ...), in order."""
    return list(dict.fromkeys(key.split('.', 1)[0] for key in state_dict))


# --------------------------------------------------------------------------
# What a refused file holds, and the fix for each case
# --------------------------------------------------------------------------
def _inexact_refusal(model, unwrapped, report, purpose, partial_option):
    """The message refusing to evaluate or resume from a checkpoint that does not set every tensor."""
    source, action = report.source, REFUSED_ACTION[purpose]
    not_in_file = [key for key in report.missing if key not in report.mismatched]
    lines = [
        f'refusing to {action} {source}: {len(report.missing)} of {len(model.state_dict())} tensors of '
        f'{type(model).__name__} would not come from it ({len(not_in_file)} not in it, '
        f'{len(report.mismatched)} of another shape); {"evaluating" if purpose == "test" else "resuming"} '
        'needs every tensor from the checkpoint.'
    ]
    holds, fix = _what_it_holds(model, unwrapped, report, purpose)
    lines.append(f'It holds {holds}. {fix}')
    if not_in_file:
        lines.append(f'  not in it: {_grouped(not_in_file)}')
    if report.mismatched:
        lines.append(
            '  of another shape: '
            + '; '.join(
                _shape_note(model, key, *shapes) for key, shapes in list(report.mismatched.items())[:MAX_LISTED]
            )
            + (f'; ... (+{len(report.mismatched) - MAX_LISTED})' if len(report.mismatched) > MAX_LISTED else '')
        )
    if purpose == 'test' and len(report.missing) == len(model.state_dict()):
        lines.append('No tensor of it fits this model, so a partial evaluation has nothing to load.')
    elif purpose == 'test':
        lines.append(
            'To evaluate a partial match on purpose (tensors not from the checkpoint keep their '
            f'initial, random values), {partial_option}.'
        )
    else:
        lines.append('--resume has no partial option: it continues the run that wrote the checkpoint.')
    lines.append('Nothing was loaded.')
    return '\n'.join(lines) + '\n' + report.summary()


def _what_it_holds(model, unwrapped, report, purpose):
    """``(what the file holds, the fix)`` for a checkpoint that does not set every tensor of ``model``."""
    source, state_dict = report.source, unwrapped.state_dict
    parts = parts_besides_backbone(model)
    names = top_level_names(state_dict)
    file_parts = [name for name in names if name != 'backbone']
    whole_model = bool(set(names) & set(parts)) or (
        'backbone' in names and bool(set(file_parts) - set(CLASSIFIER_PARTS))
    )
    backbone = type(getattr(model, 'backbone', model)).__name__
    if parts and not whole_model:
        fits, matched = _fits_backbone(model.backbone, unwrapped)
        if fits:
            holds = (
                f'backbone-only weights (ImageNet classification weights of this {backbone}, '
                f'{len(state_dict)} tensors: {_first(state_dict)}) and none for {", ".join(parts)}'
            )
            return holds, BACKBONE_ONLY_FIX[purpose].format(parts=', '.join(parts), source=source)
        holds = (
            f'backbone-only weights of another backbone or size ({len(state_dict)} tensors: '
            f'{_first(state_dict)}; {matched} of this config\'s {backbone}), and none for {", ".join(parts)}'
        )
        return holds, OTHER_BACKBONE_FIX[purpose]
    backbone_off = [key for key in report.missing if key.startswith('backbone.')]
    backbone_note = (
        f'its backbone fits this config\'s {backbone}'
        if not backbone_off
        else f'{len(backbone_off)} tensors of this config\'s {backbone} are not in it or of another shape'
    )
    if parts and set(file_parts) != set(parts):
        holds = (
            f'another detector or segmentor: its parts are {", ".join(file_parts) or "none"}; this '
            f'config\'s are {", ".join(parts)}; {backbone_note}'
        )
        fix = OTHER_MODEL_FIX[purpose]
        if not backbone_off:
            fix += (
                ' To train this config from its matching tensors: tools/train.py CONFIG --cfg-options '
                f'load_from={source}.'
            )
        return holds, fix
    if backbone_off:
        return f'this kind of model with another backbone or size: {backbone_note}', OTHER_SIZE_FIX[purpose]
    classes = _class_counts(model, report)
    if classes:
        counts = {theirs for theirs, _, _ in classes.values()}
        ours = next(iter(classes.values()))[1]
        options = ' '.join(f'model.{head}.num_classes={theirs}' for head, (theirs, _, _) in classes.items())
        holds = f'this model trained for {" or ".join(map(str, sorted(counts)))} classes, this config has {ours}'
        return holds, CLASSES_FIX[purpose].format(options=options, ours=ours)
    return 'this model, but not all of it (another version of the config?)', SAME_MODEL_FIX[purpose]


BACKBONE_ONLY_FIX = {
    'test': (
        'These weights are for training, not evaluating: evaluating them would run a randomly '
        'initialised {parts} (mAP or mIoU near 0). Train this config from them (tools/train.py CONFIG '
        "--cfg-options load_from={source}, or model.backbone.init_cfg=dict(type='Pretrained', "
        'checkpoint={source})) and evaluate the checkpoint tools/train.py writes.'
    ),
    'resume': (
        '--resume continues a run from a checkpoint tools/train.py wrote (weights of the whole model, '
        'optimizer, progress); start a new run from these weights instead: tools/train.py CONFIG '
        '--cfg-options load_from={source}.'
    ),
}
OTHER_BACKBONE_FIX = {
    purpose: (
        f'Neither init_cfg nor load_from can use it for this config either. {what} needs the checkpoint '
        'tools/train.py wrote for this config; for ImageNet weights of this backbone, `python '
        'tools/convert_ckpt.py SRC DST --config CONFIG` checks a file and converts it '
        '(docs/checkpoints.md).'
    )
    for purpose, what in (('test', 'Evaluating'), ('resume', '--resume'))
}
OTHER_MODEL_FIX = {
    'test': 'Evaluate it with the config it was trained with; this config needs a checkpoint tools/train.py '
    'wrote for it.',
    'resume': '--resume continues a run of this config from a checkpoint tools/train.py wrote for it; resume '
    'this file with the config it was trained with.',
}
OTHER_SIZE_FIX = {
    'test': 'Evaluate it with the config of its backbone and size, or evaluate a checkpoint tools/train.py '
    'wrote for this config.',
    'resume': 'Resume it with the config of its backbone and size.',
}
CLASSES_FIX = {
    'test': (
        'Evaluate it with a config of its classes (--cfg-options {options}, and the test dataset\'s '
        'classes to match), or evaluate a checkpoint trained on this config\'s {ours} classes.'
    ),
    'resume': 'Resume it with a config of its classes (--cfg-options {options}, and the dataset\'s classes).',
}
SAME_MODEL_FIX = {
    'test': 'Evaluate the checkpoint tools/train.py wrote for this config.',
    'resume': 'Resume from a checkpoint tools/train.py wrote for this config.',
}


def _fits_backbone(backbone, unwrapped):
    """Whether ``init_cfg`` would load the checkpoint into ``backbone``, and ``'N of M tensors match'``."""
    try:
        report, _ = fit(PretrainedPolicy().choose(backbone, unwrapped), unwrapped)
    except (CheckpointError, ValueError) as err:
        return False, f'not loadable into it: {err}'
    return (
        report.loaded_fraction >= MIN_LOADED_FRACTION,
        f'{report.num_loaded_params} of {report.num_model_params} parameter tensors match',
    )


def _class_counts(model, report):
    """``{head path: (checkpoint classes, config classes, key)}`` for tensors mismatched by the class count."""
    counts = {}
    for key, (theirs, ours) in report.mismatched.items():
        found = _classes_of(model, key, theirs, ours)
        if found:
            head, theirs_count, ours_count = found
            counts.setdefault(head, (theirs_count, ours_count, key))
    return counts


def _classes_of(model, key, checkpoint_shape, model_shape):
    """``(head path, checkpoint classes, config classes)`` if ``key`` is an output layer of a head whose
    outputs scale with its ``num_classes``; else None.

    Such layers have ``k * (num_classes + extra)`` outputs, ``extra`` 1 for a softmax's background
    class (the head's ``cls_out_channels`` says which where it has one), ``k`` anchors or box
    coordinates per class; the checkpoint's count follows from its first dimension.
    """
    if checkpoint_shape[1:] != model_shape[1:] or not model_shape:
        return None
    head_path = key.rsplit('.', 1)[0]
    while head_path:
        head = model.get_submodule(head_path)
        if isinstance(getattr(head, 'num_classes', None), int) and head.num_classes > 0:
            break
        head_path = head_path.rpartition('.')[0]
    else:
        return None
    classes = head.num_classes
    extras = [getattr(head, 'cls_out_channels', classes) - classes, 0, 1]
    for extra in dict.fromkeys(extra for extra in extras if extra >= 0):
        per_class, rest = divmod(model_shape[0], classes + extra)
        if not rest and not checkpoint_shape[0] % per_class:
            theirs = checkpoint_shape[0] // per_class - extra
            if theirs > 0:
                return head_path, theirs, classes
    return None


def _shape_note(model, key, checkpoint_shape, model_shape):
    shapes = f'checkpoint {tuple(checkpoint_shape)}, model {tuple(model_shape)}'
    found = _classes_of(model, key, checkpoint_shape, model_shape)
    if found:
        return f'{key}: the checkpoint predicts {found[1]} classes, the config {found[2]} ({shapes})'
    return f'{key}: {shapes}'


def _grouped(keys):
    """``'bbox_head (10: bbox_head.a, ...), neck (1: neck.b)'``: keys by their top-level part."""
    groups = {}
    for key in keys:
        groups.setdefault(key.split('.', 1)[0], []).append(key)
    return ', '.join(f'{part} ({len(ks)}: {_first(ks, 2)})' for part, ks in groups.items())


def _first(keys, count=3):
    keys = list(keys)
    return ', '.join(keys[:count]) + (', ...' if len(keys) > count else '')


def _check_resume_state(checkpoint, source, num_tensors):
    """Refuse to resume from ``checkpoint`` unless it holds what mmengine's ``Runner.resume`` reads."""
    absent = [repr(key) for key in RESUME_STATE if key not in checkpoint]
    meta = checkpoint.get('meta')
    if isinstance(meta, dict):
        absent += [f"meta[{key!r}]" for key in ('epoch', 'iter') if key not in meta]
    if not absent:
        return
    also = [repr(key) for key in OPTIONAL_RESUME_STATE if key not in checkpoint]
    progress = "no training progress ('meta')" if "'meta'" in absent else 'not the training state --resume restores'
    raise CheckpointError(
        f'refusing to resume from {source}: it holds the weights of this model (all {num_tensors} tensors '
        f'match) but {progress}: {", ".join(absent + also)} missing. Published or converted files keep '
        "only the weights (mmdet's publish_model.py keeps 'meta' and 'state_dict'). --resume needs a "
        'checkpoint tools/train.py wrote while training (work_dir/iter_N.pth or epoch_N.pth). To train on '
        f'from these weights, start a new run: tools/train.py CONFIG --cfg-options load_from={source} '
        '(the schedule starts again at iteration 0). Nothing was loaded.'
    )


def _check_no_renames(report, source):
    """Refuse to resume from a checkpoint whose tensors had to be renamed from an older layout.

    Its weights load, but the optimizer state mmengine resumes is a list in the parameter
    order of the model that wrote it, and that order changed with the names (Pale's
    output norms now follow all stages): resumed, momentum could land on other tensors.
    """
    if report.renamed:
        new, old = next(iter(report.renamed.items()))
        raise CheckpointError(
            f'refusing to resume from {source}: it was saved with an older layout of the backbone\'s module '
            f'names ({len(report.renamed)} tensors renamed, e.g. {old} -> {new}); its optimizer state follows '
            f'that layout\'s parameter order. Start a new run from its weights instead: tools/train.py CONFIG '
            f'--cfg-options load_from={source}. Nothing was loaded.'
        )


def _backbone_load_from_advice(source, model, names):
    """The refusal's advice when ``load_from`` puts a file (of top-level ``names``) without tensors of the other
    parts into the backbone."""
    backbone = type(model.backbone).__name__
    others = [name for name in names if name != 'backbone']
    if 'backbone' in names and set(others) - set(CLASSIFIER_PARTS):
        holds = (
            f'another detector or segmentor (its parts: {", ".join(others)}; this config\'s: '
            f'{", ".join(parts_besides_backbone(model))}), whose backbone weights load into the backbone'
        )
    else:
        holds = 'backbone-only (e.g. ImageNet classification) weights, which load into the backbone'
    return (
        f'load_from={source!r} holds {holds} as init_cfg loads them: is it a checkpoint of another '
        f'backbone or size (e.g. a ResNet-50 ImageNet checkpoint in a {backbone} config)? Use '
        f"this backbone's ImageNet checkpoint (`python tools/convert_ckpt.py SRC DST --config "
        f'CONFIG` checks one and writes it converted). To load a partial match on purpose, '
        f'{PARTIAL_LOAD_OPTION}.'
    )
