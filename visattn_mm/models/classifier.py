"""Classification forms of the backbones: the dense backbone plus a linear head.

The head reads the mean of the last stage's tokens after that stage's output
norm (``norm3`` of ViL/ViL-LS plays the part of the official final ``norm``;
VVT's ``norm4`` and Pale's last norm likewise), so the classifier's state_dict is
the dense backbone's under ``backbone.`` plus ``head.*``, and our ImageNet
checkpoints load into the dense backbones as they are.
"""
import inspect

import torch.nn as nn

from .layers import check_arch, init_transformer_weights
from .pale import PaleTransformer
from .vil import ViL, ViLLS
from .vvt import VVT

BACKBONES = {cls.__name__: cls for cls in (ViL, ViLLS, VVT, PaleTransformer)}


class Classifier(nn.Module):
    """A backbone with a classification head on the pooled last stage.

    Args:
        backbone_type (str): ``'ViL'``, ``'ViLLS'``, ``'VVT'`` or ``'PaleTransformer'``.
            Default: ``'ViL'``.
        num_classes (int): Classes of the linear head (0 for none). Default: 1000.
        **backbone_kwargs: Passed to the backbone (``out_indices`` is fixed to the
            last stage). For the official ViL/ViL-LS classification layouts set
            ``attn_types`` with ``'full'`` in stages 3-4.
    """

    def __init__(self, backbone_type='ViL', num_classes=1000, **backbone_kwargs):
        super().__init__()
        if backbone_type not in BACKBONES:
            raise ValueError(f'Classifier: backbone_type={backbone_type!r}; allowed: {sorted(BACKBONES)}')
        backbone_cls = BACKBONES[backbone_type]
        arch = backbone_kwargs.get('arch', inspect.signature(backbone_cls).parameters['arch'].default)
        num_stages = len(check_arch(arch, backbone_cls.arch_zoo, ('depths',), 'Classifier')['depths'])
        self.backbone = backbone_cls(out_indices=(num_stages - 1,), **backbone_kwargs)
        self.num_features = self.backbone.embed_dims[-1]
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
        self.head.apply(init_transformer_weights)

    def forward_features(self, x):
        return self.backbone(x)[-1].mean(dim=(2, 3))

    def forward(self, x):
        return self.head(self.forward_features(x))
