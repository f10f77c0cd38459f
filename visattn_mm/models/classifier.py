"""Classification forms of the backbones: the dense backbone plus a linear head.

The head reads the mean of the last stage's tokens after that stage's output
norm (``norm3`` of ViL/ViL-LS and Pale plays the part of the official final ``norm``;
VVT's last stage norm ``stages.3.norm`` likewise), so the classifier's state_dict is
the dense backbone's under ``backbone.`` plus ``head.*``, and our ImageNet
checkpoints load into the dense backbones as they are.

It speaks timm's model interface, as timm's hierarchical models (Swin, PVT-v2) do:
``num_classes``, ``num_features``/``head_hidden_size``, ``feature_info``,
``get_classifier``/``reset_classifier`` (``global_pool`` ``'avg'`` or ``''``),
``forward_features``/``forward_head``/``forward_intermediates``,
``prune_intermediate_layers`` (for ``features_only=True``), ``group_matcher`` (layer
decay), ``no_weight_decay`` and ``set_grad_checkpointing``; so the names registered in
:mod:`visattn_mm.timm_models` train with timm's own ``train.py``. ``load_state_dict``
also takes official release checkpoints (see there).
"""

import inspect

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from ..checkpoint import LoadReport, find_state_dict, load_pretrained
from ..checkpoint.protocol import CheckpointProtocol
from .base import tokens_to_map
from .family import BACKBONES
from .layers import init_transformer_weights
from .vil import ViL

GLOBAL_POOLS = ('avg', '')

# Parameter groups for timm's layer-wise lr decay, in timm's group_matcher format: the first
# patch embedding, then one group per block (a stage's patch embedding joins its first block,
# a stage or output norm its last block, as timm's Swin does); the head, unmatched, comes last.
STEM_GROUP = r'^backbone\.stages\.0\.patch_embed'
STAGE_GROUPS = r'^backbone\.(?:stages\.|norm)(\d+)'
BLOCK_GROUPS = [
    (r'^backbone\.stages\.(\d+)\.patch_embed', (0,)),
    (r'^backbone\.stages\.(\d+)\.blocks\.(\d+)', None),
    (r'^backbone\.stages\.(\d+)\.norm', (99999,)),
    (r'^backbone\.norm(\d+)', (99999,)),
]


def stage_indices(num_stages, indices):
    """Stage indices as timm's ``out_indices``/``indices`` give them: None (all), an int ``n``
    (the last ``n``) or a sequence (negative ones from the end).

    Returns:
        tuple: The absolute indices (list) and the largest one.

    Raises:
        ValueError: For an index outside the ``num_stages`` stages.
    """
    if indices is None:
        indices = num_stages
    if isinstance(indices, int):
        if not 0 < indices <= num_stages:
            raise ValueError(f'take the last {indices} stages: must be 1 to {num_stages}')
        indices = range(num_stages - indices, num_stages)
    absolute = [i + num_stages if i < 0 else i for i in indices]
    if not absolute or any(not 0 <= i < num_stages for i in absolute):
        raise ValueError(f'stage indices {tuple(indices)} must lie in [-{num_stages}, {num_stages - 1}]')
    return absolute, max(absolute)


def is_classifier_layout(state_dict):
    """Whether every key of ``state_dict`` is one of a classifier's (``backbone.*``, ``head.*``)."""
    return all(isinstance(k, str) and k.startswith(('backbone.', 'head.')) for k in state_dict)


class Classifier(CheckpointProtocol, nn.Module):
    """A backbone with a classification head on the pooled last stage.

    Args:
        backbone_type (str): ``'ViL'``, ``'ViLLS'``, ``'VVT'`` or ``'PaleTransformer'``.
            Default: ``'ViL'``.
        num_classes (int): Classes of the linear head (0 for none). Default: 1000.
        in_chans (int, optional): Input channels (timm's name for ``in_channels``).
        global_pool (str): ``'avg'`` (mean over the last map) or ``''`` (no pooling:
            ``forward`` gives the map, or the head applied at every position). Default: 'avg'.
        img_size (int | tuple[int, int], optional): The training resolution (timm's
            name). For ViL/ViL-LS it sizes the full-attention RPB tables
            (``pretrain_img_size``; other sizes resize them); VVT and Pale have no tensor
            sized by it, so there it is only checked. Default: the backbone's (224).
        **backbone_kwargs: Passed to the backbone (``out_indices`` is fixed to the
            last stage). For the official ViL/ViL-LS classification layouts set
            ``attn_types`` with ``'full'`` in stages 3-4.
    """

    # Parameter names containing these skip weight decay in timm's optimizer factory.
    NO_WEIGHT_DECAY_KEYWORDS = ('relative_position', 'cls_token', 'pos_embed')

    def __init__(
        self, backbone_type='ViL', num_classes=1000, in_chans=None, global_pool='avg', img_size=None, **backbone_kwargs
    ):
        super().__init__()
        if in_chans is not None:
            backbone_kwargs['in_channels'] = in_chans
        if backbone_type not in BACKBONES:
            raise ValueError(f'Classifier: backbone_type={backbone_type!r}; allowed: {sorted(BACKBONES)}')
        backbone_cls = BACKBONES[backbone_type]
        if img_size is not None:
            self._set_img_size(backbone_cls, img_size, backbone_kwargs)
        arch = backbone_kwargs.get('arch', inspect.signature(backbone_cls).parameters['arch'].default)
        num_stages = len(backbone_cls.resolve_arch(arch)['depths'])
        self.backbone = backbone_cls(out_indices=(num_stages - 1,), **backbone_kwargs)
        self.backbone_type = backbone_type
        self.num_features = self.head_hidden_size = self.backbone.embed_dims[-1]
        self.feature_info = [
            dict(num_chs=dim, reduction=stride, module=f'backbone.stages.{i}')
            for i, (dim, stride) in enumerate(zip(self.backbone.embed_dims, self.backbone.strides))
        ]
        self.global_pool = 'avg'
        self.reset_classifier(num_classes, global_pool)

    @staticmethod
    def _set_img_size(backbone_cls, img_size, backbone_kwargs):
        sides = (img_size,) * 2 if isinstance(img_size, int) else tuple(img_size)
        if len(sides) != 2 or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in sides):
            raise ValueError(f'Classifier: img_size={img_size!r} must be a positive int or (height, width)')
        if issubclass(backbone_cls, ViL):
            if 'pretrain_img_size' in backbone_kwargs:
                raise ValueError('Classifier: set img_size or pretrain_img_size (the same thing), not both')
            backbone_kwargs['pretrain_img_size'] = sides

    @torch.jit.ignore
    def get_classifier(self):
        return self.head

    def reset_classifier(self, num_classes, global_pool=None):
        """A fresh ``Linear`` head for ``num_classes`` (0: none, ``forward`` gives the pooled features).

        Args:
            num_classes (int): Classes of the new head.
            global_pool (str, optional): ``'avg'`` or ``''`` (no pooling); None keeps the current one.
        """
        if global_pool is not None:
            if global_pool not in GLOBAL_POOLS:
                raise ValueError(
                    f'Classifier: global_pool={global_pool!r}; allowed: {GLOBAL_POOLS} (\'\' keeps the map: no pooling)'
                )
            self.global_pool = global_pool
        self.num_classes = num_classes
        self.head = nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity()
        self.head.apply(init_transformer_weights)

    @torch.jit.ignore
    def no_weight_decay(self):
        """Full names of position tables and global tokens (timm's optimizer factory skips decay)."""
        return {
            name for name, _ in self.named_parameters() if any(word in name for word in self.NO_WEIGHT_DECAY_KEYWORDS)
        }

    @torch.jit.ignore
    def group_matcher(self, coarse=False):
        """Parameter groups for timm's layer-wise lr decay (``--layer-decay``): stages if
        ``coarse``, else blocks."""
        return dict(stem=STEM_GROUP, blocks=STAGE_GROUPS if coarse else BLOCK_GROUPS)

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable=True):
        # The backbone's stage loop is the one place that checkpoints blocks.
        self.backbone.with_cp = enable

    def forward_intermediates(
        self, x, indices=None, norm=False, stop_early=False, output_fmt='NCHW', intermediates_only=False
    ):
        """The stage maps timm's ``features_only`` models return, and the final features.

        Args:
            x (Tensor): ``(B, C, H, W)`` images.
            indices (int | Sequence[int], optional): Stages to return (negative from the end),
                or an int ``n`` for the last ``n``. Default: all.
            norm (bool): Pass a stage through its output norm where it has one (the last
                stage of ViL/ViL-LS and Pale; VVT's stage norms are always applied).
            stop_early (bool): Run no stage after the last one returned.
            output_fmt (str): ``'NCHW'`` only.
            intermediates_only (bool): Return only the stage maps (stops early).

        Returns:
            list[Tensor] | tuple[Tensor, list[Tensor]]: The stage maps ``(B, C_i, H/s_i,
            W/s_i)``; without ``intermediates_only`` first the output of the last stage
            run through its output norm (:meth:`forward_features` when all stages ran).
        """
        if output_fmt != 'NCHW':
            raise ValueError(f"Classifier.forward_intermediates: output_fmt={output_fmt!r}; only 'NCHW'")
        take_indices, max_index = stage_indices(self.backbone.num_stages, indices)
        intermediates = []
        for i, tokens, hw in self.backbone.iter_stages(x):
            if i in take_indices:
                intermediates.append(self.backbone.output_map(i, tokens, hw) if norm else tokens_to_map(tokens, hw))
            if i == max_index and (stop_early or intermediates_only):
                break
        if intermediates_only:
            return intermediates
        return self.backbone.output_map(i, tokens, hw), intermediates

    def prune_intermediate_layers(self, indices=1, prune_norm=False, prune_head=True):
        """Delete what the stage maps ``indices`` do not need (timm's ``features_only`` models).

        Returns:
            list[int]: ``indices`` as absolute stage indices.
        """
        take_indices, max_index = stage_indices(self.backbone.num_stages, indices)
        self.backbone.truncate(max_index + 1, keep_output_norms=not prune_norm)
        if prune_head:
            self.reset_classifier(0, '')
        return take_indices

    def forward_features(self, x):
        """The last stage's (normed) map, ``(B, C, H, W)``."""
        return self.backbone(x)[-1]

    def forward_head(self, x, pre_logits=False):
        """Pool (``global_pool='avg'``) and classify; with ``''`` the head acts at every position."""
        if self.global_pool == 'avg':
            x = x.mean(dim=(2, 3))
            return x if pre_logits else self.head(x)
        return x if pre_logits else self.head(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)

    def forward(self, x):
        return self.forward_head(self.forward_features(x))

    # Loading checkpoints: our layout as nn.Module does, official layouts through load_pretrained.

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """``nn.Module.load_state_dict``, which also takes official release checkpoints.

        Our layout (``backbone.*`` and ``head.*``, bare or in a checkpoint container)
        loads as PyTorch loads it. Anything else, e.g. an official ViL / ViL-LS / VVT
        ImageNet file as ``torch.load`` returns it (``net``/``model`` container,
        ``module.`` prefix, official key names, head included), goes through
        :func:`~visattn_mm.checkpoint.load_pretrained`: converted, position tables
        resized, the load report logged, a load matching under 90% refused.
        timm's ``create_model(name, checkpoint_path=...)`` ends here.

        Args:
            state_dict (dict): A state_dict or a checkpoint holding one.
            strict (bool): Raise a RuntimeError (after loading, as PyTorch does) if any
                model tensor stayed unset or any checkpoint tensor found no place.
            assign (bool): As in PyTorch (our layout only).

        Returns:
            NamedTuple: ``missing_keys`` and ``unexpected_keys``.
        """
        if is_classifier_layout(state_dict):  # the usual case: the dict itself, with its _metadata
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        try:
            tensors, _ = find_state_dict(state_dict)
        except ValueError:
            tensors = {}
        if tensors and is_classifier_layout(tensors):
            return super().load_state_dict(tensors, strict=strict, assign=assign)
        report = load_pretrained(self, state_dict, allow_partial=not strict)
        problems = report.missing + report.unexpected + list(report.mismatched)
        if strict and problems:
            raise RuntimeError(
                f'Classifier.load_state_dict (strict): {len(problems)} tensor(s) did not load: '
                f'{problems[:8]}. Pass strict=False to keep the partial load.\n' + report.summary()
            )
        return _IncompatibleKeys(report.missing, report.unexpected)

    def checkpoint_filter(self, state_dict, target_keys, report):
        """Official or dense-backbone layouts to ours, for :func:`load_pretrained`.

        ``head.*`` keeps its name; everything else goes through the backbone's own
        filter (official-layout conversion) and gets the ``backbone.`` prefix.
        """
        head = {k: v for k, v in state_dict.items() if k.startswith('head.')}
        body = {k: v for k, v in state_dict.items() if not k.startswith('head.')}
        prefix = 'backbone.'
        backbone_report = LoadReport(source=report.source)
        converted = self.backbone.checkpoint_filter(
            body, {k[len(prefix) :] for k in target_keys if k.startswith(prefix)}, backbone_report
        )
        report.layout = backbone_report.layout
        report.dropped.update(backbone_report.dropped)
        report.converted.update({prefix + k: v for k, v in backbone_report.converted.items()})
        report.renamed.update({prefix + k: prefix + v for k, v in backbone_report.renamed.items()})
        report.fresh.update({prefix + k: v for k, v in backbone_report.fresh.items()})
        return {**{prefix + k: v for k, v in converted.items()}, **head}
