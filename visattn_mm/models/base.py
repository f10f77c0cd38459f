"""What every backbone shares for dense prediction."""
import warnings

import torch
from mmengine.model import BaseModule, PretrainedInit, initialize
from torch.nn.modules.batchnorm import _BatchNorm

from ..checkpoint import load_pretrained


CPU_FP16_WARNING = (
    'fp16 autocast on the CPU: the backbones run several times slower than in fp32 or bf16 '
    '(the CPU kernels for float16 are slow; a Pale-T training step at 224x224 took 2.7x the '
    'fp32 time, and at 800x1216 13x the bf16 time, on a 2-core CPU). Use bf16 autocast on '
    "the CPU (torch.autocast('cpu', dtype=torch.bfloat16); timm's train.py: --amp-dtype "
    'bfloat16) or no autocast (drop --amp).')
_warned_cpu_fp16 = False


def warn_once_on_cpu_fp16_autocast(x):
    """Warn once per process when ``x`` is a CPU tensor under fp16 autocast.

    Reads only the autocast state and the device of ``x`` (no host-device sync).
    """
    global _warned_cpu_fp16
    if (not _warned_cpu_fp16 and x.device.type == 'cpu' and torch.is_autocast_enabled('cpu')
            and torch.get_autocast_dtype('cpu') == torch.float16):
        _warned_cpu_fp16 = True
        warnings.warn(CPU_FP16_WARNING, stacklevel=2)


class DenseBackbone(BaseModule):
    """Base of the backbones: ``pretrained``/``init_cfg``, frozen stages, ``norm_eval``.

    Subclasses set ``self.frozen_stages``, ``self.norm_eval``, ``self.out_indices``,
    ``self.num_stages`` (built stages), ``self.embed_dims`` and ``self.strides`` (one
    per built stage), implement ``stage_modules(i)`` (the modules of stage ``i``, its
    patch embedding first), ``_run_stages(x)`` (see :meth:`iter_stages`) and
    ``output_norm(i)``, call ``self._freeze_stages()`` at the end of ``__init__`` and
    may define ``checkpoint_filter`` / ``adaptable_keys`` for :func:`load_pretrained`.

    Args:
        pretrained (str, optional): Deprecated, use ``init_cfg``.
        init_cfg (dict | list[dict], optional): ``dict(type='Pretrained', checkpoint=PATH,
            allow_partial=False)`` loads through :func:`load_pretrained` (official
            layouts converted, a report logged, loads matching under 90% refused);
            other mmengine init configs may be listed with it.
    """

    def __init__(self, pretrained=None, init_cfg=None):
        name = type(self).__name__
        if pretrained is not None:
            if init_cfg is not None:
                raise ValueError(f'{name}: set init_cfg or pretrained, not both')
            warnings.warn(f'{name}: `pretrained` is deprecated; use init_cfg=dict(type="Pretrained", '
                          'checkpoint=...)', DeprecationWarning)
            init_cfg = dict(type='Pretrained', checkpoint=pretrained)
        super().__init__(init_cfg=init_cfg)

    def stage_modules(self, i):
        """The modules of stage ``i`` (0-based), its patch embedding first."""
        raise NotImplementedError

    def output_norm(self, i):
        """The LayerNorm that turns stage ``i``'s tokens into its output, or None."""
        raise NotImplementedError

    def _run_stages(self, x):
        raise NotImplementedError

    def iter_stages(self, x):
        """Run the built stages in turn on an NCHW batch (the classifier's timm interface uses this).

        Yields:
            tuple: ``(i, tokens, (H, W))`` after stage ``i``: its ``(B, H*W, C)`` tokens as
            the next stage reads them, before the output norm.

        Raises:
            ValueError: If ``x`` is not 4-D.
        """
        if x.dim() != 4:
            raise ValueError(f'{type(self).__name__} expects an NCHW image batch, got shape {tuple(x.shape)}')
        warn_once_on_cpu_fp16_autocast(x)
        yield from self._run_stages(x)

    def output_map(self, i, tokens, hw):
        """Stage ``i``'s output: ``tokens`` through its output norm (if any) as an NCHW map."""
        norm = self.output_norm(i)
        return tokens_to_map(tokens if norm is None else norm(tokens), hw)

    def forward(self, x):
        return tuple(self.output_map(i, tokens, hw) for i, tokens, hw in self.iter_stages(x)
                     if i in self.out_indices)

    def truncate(self, num_stages, keep_output_norms=True):
        """Delete the stages after the first ``num_stages`` (and, optionally, all output norms).

        For models that use only early stages (timm's ``features_only`` pruning);
        parameters they would never use would otherwise get no gradient.
        """
        doomed = [m for i in range(num_stages, self.num_stages) for m in self.stage_modules(i)]
        if not keep_output_norms:
            doomed += [self.output_norm(i) for i in range(num_stages) if self.output_norm(i) is not None]
            self.out_indices = ()
        for parent in list(self.modules()):
            for name, child in list(parent.named_children()):
                if any(child is m for m in doomed):
                    delattr(parent, name)
        self.num_stages = num_stages
        self.out_indices = tuple(i for i in self.out_indices if i < num_stages)
        self.embed_dims, self.strides = self.embed_dims[:num_stages], self.strides[:num_stages]
        self.frozen_stages = min(self.frozen_stages, num_stages)

    def init_weights(self):
        """Random init happens in ``__init__``; ``Pretrained`` entries load through our loader.

        ``init_cfg`` may be one dict or a list of them, as mmengine allows; as in
        mmengine, the other entries (e.g. ``TruncNormal``) are applied first and the
        ``Pretrained`` ones last, so the checkpoint wins.

        Raises:
            TypeError: If an ``init_cfg`` entry is not a dict with a ``type``.
        """
        entries = self.init_cfg if isinstance(self.init_cfg, (list, tuple)) else [self.init_cfg]
        entries = [entry for entry in entries if entry]
        for entry in entries:
            if not isinstance(entry, dict) or 'type' not in entry:
                raise TypeError(f'{type(self).__name__}: init_cfg must be a dict or a list of dicts, '
                                f"each with a type, e.g. dict(type='Pretrained', checkpoint=PATH); "
                                f'got {entry!r}')
        pretrained = [entry for entry in entries if entry['type'] in ('Pretrained', PretrainedInit)]
        if not pretrained:
            super().init_weights()
            return
        others = [entry for entry in entries if entry['type'] not in ('Pretrained', PretrainedInit)]
        if others:
            initialize(self, others)
        for entry in pretrained:
            load_pretrained(self, entry['checkpoint'], allow_partial=entry.get('allow_partial', False))
        self._is_init = True

    def _freeze_stages(self):
        """-1: nothing; 0: the first patch embedding; i: stages 1..i.

        Called in ``__init__`` (so DistributedDataParallel never sees these
        parameters as trainable) and again in ``train()``.
        """
        frozen = [self.stage_modules(0)[0]] if self.frozen_stages >= 0 else []
        for i in range(self.frozen_stages):
            frozen.extend(self.stage_modules(i))
        for module in frozen:
            module.eval()
            for p in module.parameters():
                p.requires_grad = False

    def train(self, mode=True):
        super().train(mode)
        self._freeze_stages()
        if mode and self.norm_eval:
            for m in self.modules():
                if isinstance(m, _BatchNorm):
                    m.eval()
        return self


def tokens_to_map(tokens, hw):
    """``(B, H*W, C)`` tokens as a contiguous ``(B, C, H, W)`` map."""
    return tokens.transpose(1, 2).reshape(tokens.shape[0], -1, *hw).contiguous()
