"""Reading ImageNet/official checkpoints into the backbones, with a load report."""
from .formats import read_checkpoint, unwrap_state_dict
from .loader import LoadReport, load_pretrained

__all__ = ['LoadReport', 'load_pretrained', 'read_checkpoint', 'unwrap_state_dict']
