"""Efficient-attention vision backbones (ViL, ViL-LS, VVT, Pale) for mmdet 3.x and mmsegmentation 1.x.

Importing the package registers the backbones and hooks (see :mod:`visattn_mm.registry`).
"""

from . import registry  # noqa: F401  (registration side effect)
from .compat import allow_mmengine_checkpoints
from .engine import RandomShiftHook, RngStateHook
from .models import Classifier, PaleTransformer, ViL, ViLLS, VVT

allow_mmengine_checkpoints()  # resume works under torch's weights_only default

__version__ = '0.1.0'
__all__ = ['ViL', 'ViLLS', 'VVT', 'PaleTransformer', 'Classifier', 'RandomShiftHook', 'RngStateHook']
