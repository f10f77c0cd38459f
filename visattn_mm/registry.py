"""The one place where visattn_mm registers into the OpenMMLab registries.

Classes go into mmengine's root registries: mmdet's and mmseg's registries are
children of those and fall back to their parent, so one registration serves
configs with ``default_scope='mmdet'`` and ``default_scope='mmseg'`` alike.
"""

from mmengine.registry import HOOKS, MODELS, OPTIM_WRAPPER_CONSTRUCTORS, RUNNERS

from . import timm_models  # noqa: F401  (registers the timm.create_model names)
from .engine import (
    CheckpointPolicyRunner,
    LayerDecayOptimWrapperConstructor,
    PlainGroupsOptimWrapperConstructor,
    RandomShiftHook,
    RngStateHook,
)
from .models import FAMILIES

try:  # needs mmdet and mmcv's compiled ops; the backbones alone need neither
    from .engine.det_tta import InstanceAwareDetTTAModel
except ImportError:
    InstanceAwareDetTTAModel = None

for family in FAMILIES:
    MODELS.register_module(module=family.cls)
HOOKS.register_module(module=RandomShiftHook)
HOOKS.register_module(module=RngStateHook)
RUNNERS.register_module(module=CheckpointPolicyRunner)
OPTIM_WRAPPER_CONSTRUCTORS.register_module(module=PlainGroupsOptimWrapperConstructor)
OPTIM_WRAPPER_CONSTRUCTORS.register_module(module=LayerDecayOptimWrapperConstructor)
if InstanceAwareDetTTAModel is not None:
    MODELS.register_module(module=InstanceAwareDetTTAModel)
