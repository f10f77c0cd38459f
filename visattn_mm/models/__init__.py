"""Backbone skeletons (nn.Modules); attention math lives in visattn_mm.ops."""

from .classifier import Classifier
from .family import BACKBONES, FAMILIES, Family
from .pale import PaleTransformer
from .vil import ViL, ViLLS, set_random_shift
from .vil_attention import SlidingChunkAttention
from .vvt import VVT

__all__ = [
    'BACKBONES',
    'FAMILIES',
    'Family',
    'ViL',
    'ViLLS',
    'VVT',
    'PaleTransformer',
    'Classifier',
    'SlidingChunkAttention',
    'set_random_shift',
]
