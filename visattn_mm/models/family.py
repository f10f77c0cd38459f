"""The backbone families, one row each: the registry, the timm names and the tools' model names
derive from this table. A fifth backbone is its model file, its ops and a row here (docs/design.md).
"""

import dataclasses

from .base import preset_names
from .pale import PaleTransformer
from .vil import ViL, ViLLS
from .vvt import VVT

# The official classification layouts: full attention in the last two stages.
VIL_CLASSIFICATION_ATTN = ('sliding_chunk', 'sliding_chunk', 'full', 'full')
VIL_LS_CLASSIFICATION_ATTN = ('long_short', 'long_short', 'full', 'full')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """One backbone family.

    Args:
        cls (type): The dense backbone, registered in mmengine's ``MODELS``.
        title (str): The family's name in prose and docstrings (``'ViL-LS'``).
        name (str): The tools' name of the family; a model is ``name`` and the size's first letter
            (``'vil-ls-s'``, see :meth:`model_name`), a timm name ``name`` with underscores and the size
            (``'vil_ls_small'``, see :meth:`timm_name`). The sizes are the presets of ``cls.arch_zoo``.
        compared_size (str): The size the tools set beside Swin-T (the papers' peers of Swin-T).
        classification (dict): What every size's timm classifier passes its backbone (the ImageNet
            layout). Default: nothing.
        classification_by_size (dict): More of it for some sizes, ``{size: kwargs}``. Default: none.
    """

    cls: type
    title: str
    name: str
    compared_size: str
    classification: dict = dataclasses.field(default_factory=dict)
    classification_by_size: dict = dataclasses.field(default_factory=dict)

    @property
    def sizes(self):
        """The arch presets of :attr:`cls`, smallest first."""
        return preset_names(self.cls.arch_zoo)

    def model_name(self, size):
        """The tools' name of ``size``: ``'vil-s'`` for ViL's ``'small'``."""
        return f'{self.name}-{size[0]}'

    @property
    def compared_model(self):
        """The tools' name of :attr:`compared_size`."""
        return self.model_name(self.compared_size)

    def timm_name(self, size):
        """timm's name of ``size``: ``'vil_small'`` for ViL's ``'small'``."""
        return f'{self.name.replace("-", "_")}_{size}'

    def classifier_kwargs(self, size):
        """What the timm classifier of ``size`` passes its backbone."""
        return dict(arch=size, **self.classification, **self.classification_by_size.get(size, {}))


_VIL = Family(
    cls=ViL,
    title='ViL',
    name='vil',
    compared_size='small',
    classification=dict(attn_types=VIL_CLASSIFICATION_ATTN),
)
FAMILIES = (
    _VIL,
    # ViL-LS is ViL's architecture with long-short attention: its peer is ViL's.
    dataclasses.replace(
        _VIL,
        cls=ViLLS,
        title='ViL-LS',
        name='vil-ls',
        classification=dict(attn_types=VIL_LS_CLASSIFICATION_ATTN),
    ),
    Family(cls=VVT, title='VVT', name='vvt', compared_size='small'),
    Family(
        cls=PaleTransformer,
        title='Pale',
        name='pale',
        compared_size='tiny',
        # The Pale paper's ImageNet drop path per size.
        classification_by_size=dict(
            tiny=dict(drop_path_rate=0.1), small=dict(drop_path_rate=0.3), base=dict(drop_path_rate=0.5)
        ),
    ),
)
#: The dense backbones by class name.
BACKBONES = {family.cls.__name__: family.cls for family in FAMILIES}
