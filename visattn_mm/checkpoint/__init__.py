"""Reading checkpoints into the backbones and the whole models, with a load report."""
from .formats import CheckpointError, CheckpointNotFoundError, read_checkpoint, unwrap_state_dict
from .loader import LoadReport, load_pretrained
from .policy import load_model_checkpoint

__all__ = ['CheckpointError', 'CheckpointNotFoundError', 'LoadReport', 'load_model_checkpoint',
           'load_pretrained', 'read_checkpoint', 'unwrap_state_dict']
