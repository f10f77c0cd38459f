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

CONTAINER_KEYS = ('state_dict', 'net', 'model', 'module')


def read_checkpoint(path, map_location='cpu'):
    """``torch.load`` with ``weights_only=True``, falling back to full unpickling.

    The fallback is allowed only because ``path`` is a local file the user named
    (a config or command line); it is announced with a warning that says why.

    Raises:
        FileNotFoundError: If ``path`` does not exist, naming it.
        ValueError: If the file is not a torch checkpoint.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f'checkpoint file not found: {path!r}. Download or convert the ImageNet weights '
            '(tools/convert_ckpt.py) and point init_cfg.checkpoint at the file.')
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        first_line = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        warnings.warn(
            f'{path}: not loadable with weights_only=True ({first_line[:200]}); unpickling it fully '
            'because it is a local file you pointed to. Convert it once with tools/convert_ckpt.py '
            'to get a weights-only file.', stacklevel=2)
    except Exception as err:  # zip/pickle framing errors: truncated or not a checkpoint at all
        raise ValueError(f'{path}: not a readable torch checkpoint ({type(err).__name__}: {err}); '
                         'the file may be truncated or of another format') from err
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except Exception as err:
        raise ValueError(f'{path}: not a readable torch checkpoint ({type(err).__name__}: {err})') from err


def _is_state_dict(obj):
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def unwrap_state_dict(checkpoint):
    """Return ``(state_dict, container)``: the tensors and where they were found.

    ``container`` is ``'net'``, ``'model'``, ``'state_dict'``, ``'module'`` or
    ``'bare'``. ``module.`` prefixes are stripped; when some keys start with
    ``backbone.`` (a full detector/segmentor or our classifier) only those are
    kept, without the prefix, and ``container`` gets ``'+backbone.'``.

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
        raise ValueError(f'no state_dict of tensors found in the checkpoint (looked for a bare '
                         f'state_dict and containers {CONTAINER_KEYS}; found {found})')
    state_dict = {k[len('module.'):] if k.startswith('module.') else k: v for k, v in state_dict.items()}
    if any(k.startswith('backbone.') for k in state_dict):
        state_dict = {k[len('backbone.'):]: v for k, v in state_dict.items() if k.startswith('backbone.')}
        container += '+backbone.'
    return state_dict, container
