"""Classification forms of the backbones: the dense backbone plus a linear head.

The head reads the mean of the last stage's tokens after that stage's output
norm, so ``backbone.norm3`` plays the part of the official final ``norm`` and the
state_dict of the classifier is the dense backbone's plus ``head.*``.
"""
import torch.nn as nn

from .layers import check_arch, init_transformer_weights
from .vil import ARCH_ZOO, ViL


class ViLClassifier(nn.Module):
    """ViL with a classification head on the pooled last stage.

    Args:
        num_classes (int): Classes of the linear head (0 for none). Default: 1000.
        **backbone_kwargs: Passed to :class:`ViL` (``out_indices`` is fixed to the
            last stage).
    """

    def __init__(self, num_classes=1000, **backbone_kwargs):
        super().__init__()
        arch = backbone_kwargs.setdefault('arch', 'small')
        num_stages = len(check_arch(arch, ARCH_ZOO, ('depths',), 'ViLClassifier')['depths'])
        self.backbone = ViL(out_indices=(num_stages - 1,), **backbone_kwargs)
        self.num_features = self.backbone.embed_dims[-1]
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
        self.head.apply(init_transformer_weights)

    def forward_features(self, x):
        return self.backbone(x)[-1].mean(dim=(2, 3))

    def forward(self, x):
        return self.head(self.forward_features(x))
