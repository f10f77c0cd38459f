"""Backbone skeletons (nn.Modules); attention math lives in visattn_mm.ops."""
from .classifier import ViLClassifier
from .vil import ViL, SlidingChunkAttention, set_random_shift

__all__ = ['ViL', 'ViLClassifier', 'SlidingChunkAttention', 'set_random_shift']
