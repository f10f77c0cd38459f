"""The optimizer-wrapper constructor of our configs: mmengine's default, with plain-dict parameter groups."""

from mmengine.optim import DefaultOptimWrapperConstructor


class PlainGroupsOptimWrapperConstructor(DefaultOptimWrapperConstructor):
    """mmengine's :class:`~mmengine.optim.DefaultOptimWrapperConstructor` (``paramwise_cfg`` and all),
    whose optimizer keeps its parameter groups as plain dicts.

    With a ``paramwise_cfg`` the default constructor passes the groups to the optimizer inside a
    ``ConfigDict``, and the optimizer keeps those objects: ``torch.compile`` (mmengine's
    ``compile=True``) cannot trace an optimizer step over them (``InternalTorchDynamoError:
    AttributeError: 'UserDefinedDictVariable' object has no attribute 'items'``). The groups hold
    the same parameters and values either way.
    """

    def __call__(self, model):
        wrapper = super().__call__(model)
        groups = wrapper.optimizer.param_groups
        groups[:] = [dict(group) for group in groups]
        return wrapper
