"""Reading a checkpoint file and finding the backbone's state_dict inside it.

Containers seen in the wild: ``net`` (ViL and ViL-LS official), ``model`` (VVT
official, timm training), ``state_dict`` (mmengine/mmdet/mmseg, timm), ``module``,
or a bare state_dict. Keys may carry ``module.`` (DataParallel) and, in full
detector/segmentor checkpoints, ``backbone.``.
"""

import os
import pickle
import warnings

import torch

from ..compat import mmengine_checkpoint_globals

CONTAINER_KEYS = ('state_dict', 'net', 'model', 'module')


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, holding no weights, or of another model.

    Its message is complete (the file, the problem, the fix), so the tools print it
    without a traceback.
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist."""


MISSING_FILE_HELP = (
    'Get ImageNet weights by converting an official release with tools/convert_ckpt.py '
    '(e.g. `python tools/convert_ckpt.py vil_small_official.pth checkpoints/vil_small.pth --config CONFIG`) '
    'or by training a timm classifier (tools/timm_train.py, e.g. --model vil_small) and pointing '
    'init_cfg.checkpoint at its checkpoint; or train from scratch with '
    '`--cfg-options model.backbone.init_cfg=None`.'
)


def _reason(err):
    """The informative line of a load error (torch's weights-only errors wrap it in advice)."""
    message = str(err)
    marker = 'WeightsUnpickler error:'
    if marker in message:
        message = message.split(marker, 1)[1]
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:200]


REREAD_HELP = (
    'Re-download or re-convert it (tools/convert_ckpt.py), or point to another .pth file written by torch.save.'
)


def _not_a_checkpoint(path, err, detected):
    return CheckpointError(
        f'{path}: not a readable torch checkpoint: {detected} ({type(err).__name__}: {_reason(err)}). {REREAD_HELP}'
    )


def read_checkpoint(path, map_location='cpu'):
    """``torch.load`` with ``weights_only=True``, falling back to full unpickling.

    The fallback is allowed only because ``path`` is a local file the user named
    (a config or command line), only for a pickle that references classes outside
    the weights-only allow-list (e.g. ``argparse.Namespace`` arguments), never for
    bytes that are not a pickle at all; it is announced with a warning that says why.

    Raises:
        CheckpointNotFoundError: If ``path`` does not exist, naming it and how to get it.
        CheckpointError: If the file is not a torch checkpoint (truncated, empty, text,
            random bytes, another pickle format), naming the file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(
            f'checkpoint file not found: {path!r} (working directory {os.getcwd()!r}). ' + MISSING_FILE_HELP
        )
    if os.path.getsize(path) == 0:
        raise CheckpointError(
            f'{path}: the file is empty (0 bytes; an interrupted download, copy or '
            f'save leaves such files). {REREAD_HELP}'
        )
    try:
        with mmengine_checkpoint_globals():  # the Runner's own checkpoints, allowed for this load only
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        message = str(err)
        if 'global' not in message.lower():  # e.g. "Unsupported operand": not a pickle of objects
            raise _not_a_checkpoint(path, err, 'its bytes are not a torch pickle') from err
        warnings.warn(
            f'{path}: not loadable with weights_only=True ({_reason(err)}); unpickling it fully '
            'because it is a local file you pointed to. Convert it once with tools/convert_ckpt.py '
            'to get a weights-only file.',
            stacklevel=2,
        )
    except Exception as err:  # zip/pickle framing errors: truncated or not a checkpoint at all
        raise _not_a_checkpoint(path, err, 'the file may be truncated or of another format') from err
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:
        raise _not_a_checkpoint(path, err, 'full unpickling failed too') from err


def _is_state_dict(obj):
    return (
        isinstance(obj, dict)
        and bool(obj)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def find_state_dict(checkpoint):
    """Return ``(state_dict, container)``: the tensors as saved, ``module.`` prefixes stripped.

    ``container`` is ``'net'``, ``'model'``, ``'state_dict'``, ``'module'`` or ``'bare'``.

    Raises:
        ValueError: If no state_dict of tensors is found.
    """
    container = None
    if _is_state_dict(checkpoint):
        state_dict, container = checkpoint, 'bare'
    elif isinstance(checkpoint, dict):
        for key in CONTAINER_KEYS:
            if _is_state_dict(checkpoint.get(key)):
                state_dict, container = checkpoint[key], key
                break
    if container is None:
        found = sorted(checkpoint)[:8] if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise ValueError(
            f'no state_dict of tensors found in the checkpoint (looked for a bare '
            f'state_dict and containers {CONTAINER_KEYS}; found {found})'
        )
    return {k[len('module.') :] if k.startswith('module.') else k: v for k, v in state_dict.items()}, container


def unwrap_state_dict(checkpoint):
    """Return ``(state_dict, container)``: the backbone's tensors and where they were found.

    As :func:`find_state_dict`; in addition, when some keys start with ``backbone.``
    (a full detector/segmentor or our classifier) only those are kept, without the
    prefix, and ``container`` gets ``'+backbone.'``.

    Raises:
        ValueError: If no state_dict of tensors is found.
    """
    return backbone_tensors(*find_state_dict(checkpoint))


def backbone_tensors(state_dict, container):
    """``(state_dict, container)`` of a backbone: where keys start with ``backbone.``, only those, unprefixed.

    Args:
        state_dict (dict): Tensors as :func:`find_state_dict` returns them.
        container (str): Where they were found; ``'+backbone.'`` is added when the prefix is taken off.
    """
    if any(k.startswith('backbone.') for k in state_dict):
        state_dict = {k[len('backbone.') :]: v for k, v in state_dict.items() if k.startswith('backbone.')}
        container += '+backbone.'
    return state_dict, container
