"""Classification forms of the backbones: the dense backbone plus a linear head.

The head reads the mean of the last stage's tokens after that stage's output
norm (``norm3`` of ViL/ViL-LS plays the part of the official final ``norm``;
VVT's ``norm4`` and Pale's last norm likewise), so the classifier's state_dict is
the dense backbone's under ``backbone.`` plus ``head.*``, and our ImageNet
checkpoints load into the dense backbones as they are.

It also speaks timm's model interface (``num_classes``, ``get_classifier``,
``reset_classifier``, ``forward_features``/``forward_head``, ``no_weight_decay``,
``set_grad_checkpointing``), so the names registered in :mod:`visattn_mm.timm_models`
train with timm's own ``train.py``.
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
            ``attn_types`` with ``'full'`` in stages 3-4. timm's names ``in_chans`` and
            ``global_pool`` (only ``'avg'``) are accepted too.
    """

    # Parameter names containing these skip weight decay in timm's optimizer factory.
    NO_WEIGHT_DECAY_KEYWORDS = ('relative_position', 'cls_token', 'pos_embed')

    def __init__(self, backbone_type='ViL', num_classes=1000, in_chans=None, global_pool='avg',
                 **backbone_kwargs):
        super().__init__()
        if in_chans is not None:
            backbone_kwargs['in_channels'] = in_chans
        self._check_pool(global_pool)
        if backbone_type not in BACKBONES:
            raise ValueError(f'Classifier: backbone_type={backbone_type!r}; allowed: {sorted(BACKBONES)}')
        backbone_cls = BACKBONES[backbone_type]
        arch = backbone_kwargs.get('arch', inspect.signature(backbone_cls).parameters['arch'].default)
        num_stages = len(check_arch(arch, backbone_cls.arch_zoo, ('depths',), 'Classifier')['depths'])
        self.backbone = backbone_cls(out_indices=(num_stages - 1,), **backbone_kwargs)
        self.num_features = self.backbone.embed_dims[-1]
        self.global_pool = 'avg'
        self.reset_classifier(num_classes)

    @staticmethod
    def _check_pool(global_pool):
        if global_pool not in (None, 'avg'):
            raise ValueError(f"Classifier: global_pool={global_pool!r}; only 'avg' is supported")

    def get_classifier(self):
        return self.head

    def reset_classifier(self, num_classes, global_pool=None):
        """A fresh ``Linear`` head for ``num_classes`` (0: none, ``forward`` gives pooled features)."""
        self._check_pool(global_pool)
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
        self.head.apply(init_transformer_weights)

    def no_weight_decay(self):
        """Full names of position tables and global tokens (timm's optimizer factory skips decay)."""
        return {name for name, _ in self.named_parameters()
                if any(word in name for word in self.NO_WEIGHT_DECAY_KEYWORDS)}

    def set_grad_checkpointing(self, enable=True):
        for module in self.modules():
            if hasattr(module, 'with_cp'):
                module.with_cp = enable

    def forward_features(self, x):
        """The last stage's (normed) map, ``(B, C, H, W)``."""
        return self.backbone(x)[-1]

    def forward_head(self, x, pre_logits=False):
        x = x.mean(dim=(2, 3))
        return x if pre_logits else self.head(x)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))
