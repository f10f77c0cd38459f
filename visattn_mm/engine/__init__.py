"""Training-loop pieces (mmengine hooks)."""
from .random_shift_hook import RandomShiftHook
from .rng_state_hook import RngStateHook

__all__ = ['RandomShiftHook', 'RngStateHook']
