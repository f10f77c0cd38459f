"""Reading checkpoints into the backbones and the whole models, with a load report."""

from .formats import CheckpointError, CheckpointNotFoundError, find_state_dict, read_checkpoint, unwrap_state_dict
from .loader import LoadReport
from .policy import load_model_checkpoint, load_pretrained

__all__ = [
    'CheckpointError',
    'CheckpointNotFoundError',
    'LoadReport',
    'find_state_dict',
    'load_model_checkpoint',
    'load_pretrained',
    'read_checkpoint',
    'unwrap_state_dict',
]
