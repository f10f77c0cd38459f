"""Training-loop pieces (mmengine hooks, the Runner with the checkpoint policy, the optimizer-wrapper constructors)."""

from .optim_constructor import LayerDecayOptimWrapperConstructor, PlainGroupsOptimWrapperConstructor
from .random_shift_hook import RandomShiftHook
from .rng_state_hook import RngStateHook
from .runner import CheckpointPolicyRunner

__all__ = [
    'CheckpointPolicyRunner',
    'LayerDecayOptimWrapperConstructor',
    'PlainGroupsOptimWrapperConstructor',
    'RandomShiftHook',
    'RngStateHook',
]
