"""Efficient-attention vision backbones (ViL, ViL-LS, VVT, Pale) for mmdet 3.x and mmsegmentation 1.x.

Importing the package registers the backbones and hooks (see :mod:`visattn_mm.registry`); it leaves
torch's weights-only allowlist as it was (:mod:`visattn_mm.compat`).
"""

from . import registry  # noqa: F401  (registration side effect)
from .engine import RandomShiftHook, RngStateHook
from .models import Classifier, PaleTransformer, ViL, ViLLS, VVT

__version__ = '0.1.0'
__all__ = ['ViL', 'ViLLS', 'VVT', 'PaleTransformer', 'Classifier', 'RandomShiftHook', 'RngStateHook']
