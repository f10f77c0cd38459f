"""Reading ImageNet/official checkpoints into the backbones, with a load report."""
from .formats import find_state_dict, read_checkpoint, unwrap_state_dict
from .loader import LoadReport, load_pretrained

__all__ = ['LoadReport', 'find_state_dict', 'load_pretrained', 'read_checkpoint', 'unwrap_state_dict']
