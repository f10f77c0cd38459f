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


class LayerDecayOptimWrapperConstructor(PlainGroupsOptimWrapperConstructor):
    """Layer-wise learning-rate decay, the usual recipe for fine-tuning a transformer backbone: the
    learning rate of a backbone parameter in layer ``d`` of ``n`` is scaled by
    ``layer_decay_rate ** (n - 1 - d)`` (the layers of the backbone's ``get_layer_depth``, as
    mmpretrain defines it; the neck and heads keep the full rate), on top of what the rest of
    ``paramwise_cfg`` does (the no-decay rules of our configs).

    mmdet's and mmseg's own layer-decay constructors recognise their ConvNeXt and BEiT by class name
    and raise ``NotImplementedError`` for any other backbone; mmpretrain's calls ``get_layer_depth``
    as this one does.

    Args:
        optim_wrapper_cfg (dict): As for mmengine's constructor.
        paramwise_cfg (dict): As for mmengine's constructor, plus ``layer_decay_rate`` (float in
            (0, 1]; required).
    """

    def __init__(self, optim_wrapper_cfg, paramwise_cfg=None):
        paramwise_cfg = dict(paramwise_cfg or {})
        rate = paramwise_cfg.pop('layer_decay_rate', None)
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 < rate <= 1:
            raise ValueError(
                f'LayerDecayOptimWrapperConstructor: paramwise_cfg.layer_decay_rate={rate!r} must be a number in '
                '(0, 1], e.g. 0.9'
            )
        # mmengine's constructor gives every parameter a group of its own only with a paramwise_cfg.
        paramwise_cfg.setdefault('bias_decay_mult', 1.0)
        super().__init__(optim_wrapper_cfg, paramwise_cfg)
        self.layer_decay_rate = float(rate)

    def __call__(self, model):
        wrapper = super().__call__(model)
        model = getattr(model, 'module', model)  # a distributed wrapper's model
        backbone = getattr(model, 'backbone', None)
        if not hasattr(backbone, 'get_layer_depth'):
            raise ValueError(
                f'LayerDecayOptimWrapperConstructor: the model\'s backbone ({type(backbone).__name__}) has no '
                'get_layer_depth; use it with a visattn_mm backbone'
            )
        names = {id(param): name for name, param in model.named_parameters()}
        for group in wrapper.optimizer.param_groups:
            depth, num_layers = backbone.get_layer_depth(names[id(group['params'][0])], 'backbone.')
            group['lr'] *= self.layer_decay_rate ** (num_layers - 1 - depth)
        return wrapper
