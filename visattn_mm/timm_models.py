"""timm model names for the classification forms of the four backbones (ImageNet pretraining).

After ``import visattn_mm`` (whose registry imports this module),
``timm.create_model('pale_tiny', num_classes=1000, drop_path_rate=0.1)`` builds a
:class:`~visattn_mm.models.Classifier` through timm's ``build_model_with_cfg``, so the
model carries timm's ``pretrained_cfg``/``default_cfg`` and works with timm's
``train.py``/``validate.py`` (see ``tools/timm_train.py``), with ``features_only=True``
(stage maps at strides 4-32 through ``forward_intermediates``, ``out_indices``
selecting them) and at any input size. Its state_dict (``backbone.*`` + ``head.*``,
bare or in timm's ``{'state_dict': ...}`` checkpoint) loads into the dense backbone of
the same size through :func:`visattn_mm.checkpoint.load_pretrained`.

Nothing is built at import time; no pretrained weights are hosted. A local file loads
in one call, official ViL / ViL-LS / VVT releases included (converted, with our load
report): ``pretrained=True, pretrained_cfg_overlay=dict(file=PATH)`` or
``checkpoint_path=PATH``. Importing twice is a no-op (Python caches the module);
reloading it only makes timm warn that the names are overwritten.

Not scriptable, not FX-traceable: the skeletons and attentions branch in Python on
map sizes (input checks, padding to chunk/window multiples, per-size masks and bias
tables), which ``torch.fx`` cannot trace, and use Python that TorchScript does not
compile (generators, modules looked up by computed names). :data:`NOT_SCRIPTABLE_OR_TRACEABLE`
lists the names for test filters, as timm's own tests exclude such models by name
(``EXCLUDE_JIT_FILTERS``, ``EXCLUDE_FX_FILTERS``).
"""

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model

from .checkpoint import load_pretrained
from .models.classifier import Classifier, is_classifier_layout
from .models.family import BACKBONES, FAMILIES

# timm name -> (backbone_type, default backbone kwargs), from the family table. create_model kwargs
# override them (e.g. ``drop_path_rate``, or a small ``arch`` dict for tests); ``num_classes``,
# ``in_chans`` and ``global_pool`` go to the Classifier.
VARIANTS = {
    family.timm_name(size): (family.cls.__name__, family.classifier_kwargs(size))
    for family in FAMILIES
    for size in family.sizes
}


def _cfg(backbone_type):
    # Every variant takes any input size (ViL's full-attention tables are resized), so
    # fixed_input_size is False; pool_size is the last map of a 224 input (stride 32).
    return dict(
        url='',
        num_classes=1000,
        input_size=(3, 224, 224),
        pool_size=(7, 7),
        fixed_input_size=False,
        crop_pct=BACKBONES[backbone_type].crop_pct,
        interpolation='bicubic',
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
        first_conv='backbone.stages.0.patch_embed.proj',
        classifier='head',
    )


default_cfgs = generate_default_cfgs({name: _cfg(spec[0]) for name, spec in VARIANTS.items()})
NOT_SCRIPTABLE_OR_TRACEABLE = tuple(VARIANTS)


def _pretrained_filter(state_dict, model):
    """timm's ``pretrained_filter_fn`` (``pretrained=True`` with a file in the pretrained cfg).

    Our layout goes on to timm's own loading. Any other (an official release) is
    loaded here through :func:`load_pretrained` (conversion, resizing, the report, the
    90% rule) and the model's own state goes back to timm, whose remaining steps (it
    drops the head for another ``num_classes``) then leave the model as loaded.
    """
    if is_classifier_layout(state_dict):
        return state_dict
    # timm has read the file already; its name, for the report, is in the pretrained cfg set before loading.
    source = (getattr(model, 'pretrained_cfg', None) or {}).get('file')
    load_pretrained(model, state_dict, source=source)
    return model.state_dict()


def _create(variant, pretrained=False, **kwargs):
    backbone_type, defaults = VARIANTS[variant]
    # features_only: stage maps via forward_intermediates; an int n means the last n stages
    feature_cfg = dict(out_indices=kwargs.pop('out_indices', 4), feature_cls='getter')
    kwargs = {**defaults, **kwargs}
    return build_model_with_cfg(
        Classifier,
        variant,
        pretrained,
        backbone_type=backbone_type,
        feature_cfg=feature_cfg,
        pretrained_filter_fn=_pretrained_filter,
        **kwargs,
    )


def _entry_point(family, size):
    """timm's entry point of a family's size: ``create_model(name, ...)`` calls it."""
    variant = family.timm_name(size)

    def create(pretrained=False, **kwargs) -> Classifier:
        return _create(variant, pretrained, **kwargs)

    create.__name__ = create.__qualname__ = variant
    create.__doc__ = f'{family.title}-{size.capitalize()} classifier, ImageNet layout, trained at 224x224.'
    return register_model(create)


for _family in FAMILIES:
    for _size in _family.sizes:
        globals()[_family.timm_name(_size)] = _entry_point(_family, _size)
