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
from .models.classifier import BACKBONES, Classifier, is_classifier_layout

VIL_CLS_ATTN = ('sliding_chunk', 'sliding_chunk', 'full', 'full')  # official classification layout
VIL_LS_CLS_ATTN = ('long_short', 'long_short', 'full', 'full')

# timm name -> (backbone_type, default backbone kwargs). create_model kwargs override them
# (e.g. ``drop_path_rate``, or a small ``arch`` dict for tests); ``num_classes``,
# ``in_chans`` and ``global_pool`` go to the Classifier.
VARIANTS = {}
for _size in ('tiny', 'small', 'medium', 'base'):
    VARIANTS[f'vil_{_size}'] = ('ViL', dict(arch=_size, attn_types=VIL_CLS_ATTN))
    VARIANTS[f'vil_ls_{_size}'] = ('ViLLS', dict(arch=_size, attn_types=VIL_LS_CLS_ATTN))
for _size in ('tiny', 'small', 'medium', 'large'):
    VARIANTS[f'vvt_{_size}'] = ('VVT', dict(arch=_size))
for _size, _drop_path in (('tiny', 0.1), ('small', 0.3), ('base', 0.5)):  # Pale paper's ImageNet drop path
    VARIANTS[f'pale_{_size}'] = ('PaleTransformer', dict(arch=_size, drop_path_rate=_drop_path))


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


@register_model
def vil_tiny(pretrained=False, **kwargs) -> Classifier:
    """ViL-Tiny classifier, ImageNet layout, trained at 224x224."""
    return _create('vil_tiny', pretrained, **kwargs)


@register_model
def vil_small(pretrained=False, **kwargs) -> Classifier:
    """ViL-Small classifier, ImageNet layout, trained at 224x224."""
    return _create('vil_small', pretrained, **kwargs)


@register_model
def vil_medium(pretrained=False, **kwargs) -> Classifier:
    """ViL-Medium classifier, ImageNet layout, trained at 224x224."""
    return _create('vil_medium', pretrained, **kwargs)


@register_model
def vil_base(pretrained=False, **kwargs) -> Classifier:
    """ViL-Base classifier, ImageNet layout, trained at 224x224."""
    return _create('vil_base', pretrained, **kwargs)


@register_model
def vil_ls_tiny(pretrained=False, **kwargs) -> Classifier:
    """ViL-LS-Tiny classifier, ImageNet layout, trained at 224x224."""
    return _create('vil_ls_tiny', pretrained, **kwargs)


@register_model
def vil_ls_small(pretrained=False, **kwargs) -> Classifier:
    """ViL-LS-Small classifier, ImageNet layout, trained at 224x224."""
    return _create('vil_ls_small', pretrained, **kwargs)


@register_model
def vil_ls_medium(pretrained=False, **kwargs) -> Classifier:
    """ViL-LS-Medium classifier, ImageNet layout, trained at 224x224."""
    return _create('vil_ls_medium', pretrained, **kwargs)


@register_model
def vil_ls_base(pretrained=False, **kwargs) -> Classifier:
    """ViL-LS-Base classifier, ImageNet layout, trained at 224x224."""
    return _create('vil_ls_base', pretrained, **kwargs)


@register_model
def vvt_tiny(pretrained=False, **kwargs) -> Classifier:
    """VVT-Tiny classifier, ImageNet layout, trained at 224x224."""
    return _create('vvt_tiny', pretrained, **kwargs)


@register_model
def vvt_small(pretrained=False, **kwargs) -> Classifier:
    """VVT-Small classifier, ImageNet layout, trained at 224x224."""
    return _create('vvt_small', pretrained, **kwargs)


@register_model
def vvt_medium(pretrained=False, **kwargs) -> Classifier:
    """VVT-Medium classifier, ImageNet layout, trained at 224x224."""
    return _create('vvt_medium', pretrained, **kwargs)


@register_model
def vvt_large(pretrained=False, **kwargs) -> Classifier:
    """VVT-Large classifier, ImageNet layout, trained at 224x224."""
    return _create('vvt_large', pretrained, **kwargs)


@register_model
def pale_tiny(pretrained=False, **kwargs) -> Classifier:
    """Pale-Tiny classifier, ImageNet layout, trained at 224x224."""
    return _create('pale_tiny', pretrained, **kwargs)


@register_model
def pale_small(pretrained=False, **kwargs) -> Classifier:
    """Pale-Small classifier, ImageNet layout, trained at 224x224."""
    return _create('pale_small', pretrained, **kwargs)


@register_model
def pale_base(pretrained=False, **kwargs) -> Classifier:
    """Pale-Base classifier, ImageNet layout, trained at 224x224."""
    return _create('pale_base', pretrained, **kwargs)
