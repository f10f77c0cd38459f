"""Training-loop pieces (mmengine hooks, the Runner with the checkpoint policy, the optimizer-wrapper constructor)."""

from .optim_constructor import PlainGroupsOptimWrapperConstructor
from .random_shift_hook import RandomShiftHook
from .rng_state_hook import RngStateHook
from .runner import CheckpointPolicyRunner

__all__ = ['CheckpointPolicyRunner', 'PlainGroupsOptimWrapperConstructor', 'RandomShiftHook', 'RngStateHook']
