"""Checkpoints given to a whole detector or segmentor: ``load_from``, ``tools/test.py``, ``--resume``.

One policy, the one ``init_cfg`` follows (:func:`~.loader.load_pretrained`): a report
of what was loaded, and a refusal, with that report, when less than 90% of the model
would be set. On top of it, what a whole-model load must know about the file:

* a checkpoint holding only backbone weights (an ImageNet classification checkpoint:
  official ViL / ViL-LS / VVT releases, timm or our classifier, torchvision) has no
  tensors for the neck and heads. ``load_from`` loads it into ``model.backbone``
  exactly as ``init_cfg`` would (official layouts converted, full-attention ``qkv``
  split); evaluating it (``tools/test.py``) or resuming from it is refused;
* any other checkpoint is matched against the whole model.
"""
from .formats import CheckpointError, find_state_dict
from .loader import LoadReport, load_pretrained, load_state_dict_with_report

PURPOSES = ('load_from', 'test', 'resume')

PARTIAL_LOAD_FIX = ('To load a partial match on purpose, set load_from_allow_partial=True in the '
                    'config (--cfg-options load_from_allow_partial=True).')
INIT_FROM_IMAGENET = ("model.backbone.init_cfg=dict(type='Pretrained', checkpoint=FILE) or "
                      'load_from=FILE (which loads classification checkpoints into the backbone)')
WHOLE_MODEL_ADVICE = {
    'load_from': ('is it a checkpoint of another model (another backbone, size or detector)? '
                  'Use a checkpoint of this config\'s model; to start from ImageNet weights use '
                  f'{INIT_FROM_IMAGENET}. {PARTIAL_LOAD_FIX}'),
    'test': ('is it a checkpoint of another model (another backbone, size or detector)? '
             'tools/test.py needs the checkpoint that tools/train.py wrote for this config.'),
    'resume': ('is it a checkpoint of another model (another backbone, size or detector)? '
               '--resume continues a run of this config from a checkpoint tools/train.py wrote '
               'for it.'),
}
REFUSED_ACTION = {'test': 'evaluate', 'resume': 'resume from'}
BACKBONE_ONLY_FIX = {
    'test': ('Evaluating it would run a randomly initialised {parts} (mAP or mIoU near 0). '
             'tools/test.py needs the checkpoint that tools/train.py wrote for this config; to '
             'train from these weights use ' + INIT_FROM_IMAGENET + ' with tools/train.py.'),
    'resume': ('--resume continues a run from a checkpoint tools/train.py wrote (weights of the '
               'whole model, optimizer, progress); start a new run from these weights with '
               + INIT_FROM_IMAGENET + ' instead.'),
}


def load_model_checkpoint(model, checkpoint, source, purpose, allow_partial=False, logger=None):
    """Load a checkpoint given to the whole model, or refuse it with the reason and the fix.

    Args:
        model (nn.Module): The detector or segmentor (not wrapped in DDP).
        checkpoint (dict): The checkpoint, already read.
        source (str): The file's name, for the messages.
        purpose (str): ``'load_from'`` (start training from it), ``'test'`` (evaluate
            it) or ``'resume'`` (continue the run that wrote it).
        allow_partial (bool): With ``'load_from'``, load even if less than 90% matches.
        logger (MMLogger, optional): Where the report goes. Default: mmengine's current logger.

    Returns:
        LoadReport: What was loaded (into ``model.backbone`` for a backbone-only
        checkpoint given to ``load_from``).

    Raises:
        CheckpointError: If the checkpoint holds no state_dict, holds only backbone
            weights (for ``'test'`` and ``'resume'``), has no progress to resume, or
            matches less than 90% of the model (of the backbone, for a backbone-only
            checkpoint). Nothing is loaded then.
    """
    if purpose not in PURPOSES:
        raise ValueError(f'purpose={purpose!r}; allowed: {PURPOSES}')
    allow_partial = allow_partial and purpose == 'load_from'
    try:
        state_dict, container = find_state_dict(checkpoint)
    except ValueError as err:
        raise CheckpointError(f'{source}: {err}. Is it a model checkpoint?') from None
    parts = parts_besides_backbone(model)
    if parts and not any(key.split('.', 1)[0] in parts for key in state_dict):
        if purpose == 'load_from':
            return load_pretrained(model.backbone, checkpoint, allow_partial, logger, source=source,
                                   advice=_backbone_advice(source, model))
        raise CheckpointError(
            f'refusing to {REFUSED_ACTION[purpose]} {source}: it holds backbone-only (e.g. ImageNet classification) '
            f'weights, {len(state_dict)} tensors ({_first_keys(state_dict)}), none for '
            f'{", ".join(parts)}. ' + BACKBONE_ONLY_FIX[purpose].format(parts=', '.join(parts)))
    if purpose == 'resume' and 'meta' not in checkpoint:
        raise CheckpointError(
            f'refusing to resume from {source}: it holds weights ({container!r}) but no training '
            "progress ('meta'); --resume needs a checkpoint tools/train.py wrote. Start a new run "
            f'from these weights with load_from={source!r} instead.')
    report = LoadReport(source=str(source), container=container, layout='whole model')
    return load_state_dict_with_report(model, state_dict, report, allow_partial,
                                       WHOLE_MODEL_ADVICE[purpose], logger)


def parts_besides_backbone(model):
    """Names of ``model``'s top-level modules other than ``backbone`` that hold tensors.

    Empty for a model without a ``backbone``: every checkpoint is then matched whole.
    """
    if not hasattr(model, 'backbone'):
        return []
    return [name for name, child in model.named_children()
            if name != 'backbone' and len(child.state_dict())]


def _first_keys(state_dict, count=3):
    keys = list(state_dict)
    return ', '.join(keys[:count]) + (', ...' if len(keys) > count else '')


def _backbone_advice(source, model):
    backbone = type(model.backbone).__name__
    return (f'load_from={source!r} holds backbone-only (e.g. ImageNet classification) weights, '
            f'which load into the backbone as init_cfg loads them: is it a checkpoint of another '
            f'backbone or size (e.g. a ResNet-50 ImageNet checkpoint in a {backbone} config)? Use '
            f"this backbone's ImageNet checkpoint (`python tools/convert_ckpt.py SRC DST --config "
            f'CONFIG` checks one and writes it converted). {PARTIAL_LOAD_FIX}')
