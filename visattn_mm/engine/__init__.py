"""Training-loop pieces (mmengine hooks)."""
from .random_shift_hook import RandomShiftHook

__all__ = ['RandomShiftHook']
