"""What every backbone shares for dense prediction: one skeleton.

:class:`DenseBackbone` owns everything that is not a backbone's own layers:

* presets: ``arch_zoo`` (names and aliases) with a custom-dict escape hatch and
  per-stage defaults (:meth:`DenseBackbone.resolve_arch`);
* the mmdet surface, documented, validated and stored once: ``out_indices``,
  ``frozen_stages``, ``norm_eval``, ``with_cp``, ``compile_blocks``, ``cuda_graphs``, ``init_cfg`` /
  ``pretrained`` (``DenseBackbone.__init__``, which each backbone's ``__init__`` passes
  them on to), checked against the arch with ``in_channels`` and ``drop_path_rate``
  (:meth:`DenseBackbone.init_stages`);
* the body from a backbone's stage builder (:meth:`DenseBackbone.build_stages`): the
  stages, the output norms, the random init and the frozen stages;
* the stage loop (patch embedding, blocks with optional gradient checkpointing and
  compilation, stage output) and the output maps, for mmdet/mmseg and timm alike;
* the checkpoint protocol (:class:`~visattn_mm.checkpoint.protocol.CheckpointProtocol`):
  a backbone declares its ``checkpoint_filter`` function and how its tables resize;
  the load pre-hook registered here applies that on every load path.

One module layout for every backbone: ``stages.{i}`` (:class:`Stage`: ``patch_embed``,
``blocks`` and, where the architecture has one, the ``norm`` the next stage reads) and
the output norms ``norm{i}`` of the stages in ``out_indices`` (0-based, as mmdet's Swin).
Official checkpoints of another layout are converted by each backbone's filter; the
numbered layout of the official VVT code (``patch_embed{n}``, ``block{n}``, ``norm{n}``,
1-based), which VVT and Pale used before, is renamed on every load path
(:func:`rename_numbered_stage_keys`).
"""

import re
import warnings

import torch
import torch.nn as nn
from mmengine.model import BaseModule, PretrainedInit, initialize
from torch.nn.modules.batchnorm import _BatchNorm

from ..checkpoint import load_pretrained
from ..checkpoint.protocol import CheckpointProtocol
from ..ops.process_state import STATE
from .block_compile import BlockCompiler, call_block, check_compile_option
from .cuda_graphs import GraphedForward, check_cuda_graphs_option
from .layers import (
    check_arch,
    check_int,
    check_mlp_ratio,
    check_stage_args,
    check_stage_lengths,
    linear_drop_path_rates,
)

CPU_FP16_WARNING = (
    'fp16 autocast on the CPU: the backbones run several times slower than in fp32 or bf16 '
    '(the CPU kernels for float16 are slow; a Pale-T training step at 224x224 took 2.7x the '
    'fp32 time, and at 800x1216 13x the bf16 time, on a 2-core CPU). Use bf16 autocast on '
    "the CPU (torch.autocast('cpu', dtype=torch.bfloat16); timm's train.py: --amp-dtype "
    'bfloat16) or no autocast (drop --amp).'
)


def warn_once_on_cpu_fp16_autocast(x):
    """Warn once per process when ``x`` is a CPU tensor under fp16 autocast.

    Reads only the autocast state and the device of ``x`` (no host-device sync).
    """
    if x.device.type == 'cpu' and torch.is_autocast_enabled('cpu') and torch.get_autocast_dtype('cpu') == torch.float16:
        STATE.warn_once('cpu_fp16_autocast', CPU_FP16_WARNING)


def with_aliases(presets):
    """``presets`` plus each preset under its first letter (``'s'`` for ``'small'``, the letter of the tools'
    model names), pointing at the same dicts."""
    aliases = {name[0]: spec for name, spec in presets.items()}
    if len(aliases) != len(presets):
        raise ValueError(f'arch presets {list(presets)} need distinct first letters, their aliases')
    return {**presets, **aliases}


def preset_names(arch_zoo):
    """The preset names of an ``arch_zoo`` of :func:`with_aliases`, in its order, without the aliases."""
    return tuple(name for name in arch_zoo if len(name) > 1)


class Stage(nn.Module):
    """One stage: a patch embedding, its blocks and, where the architecture has one, a stage norm.

    Args:
        patch_embed (nn.Module): NCHW map -> ``(tokens, (H, W))``.
        blocks (Sequence[nn.Module]): Each called as ``block(tokens, hw)``.
        norm (nn.Module, optional): A LayerNorm whose output the next stage reads and the
            stage returns (VVT). Output norms applied only to the returned map are not
            part of the stage (``norm{i}`` of the backbone).
    """

    def __init__(self, patch_embed, blocks, norm=None):
        super().__init__()
        self.patch_embed = patch_embed
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm

    def forward(self, x, run_block):
        """The stage on an NCHW map: its tokens after the blocks and the stage norm, and their ``(H, W)``.

        Args:
            x (Tensor): ``(B, C, H, W)``, the image or the previous stage's map.
            run_block (callable): ``run_block(block, tokens, hw)`` runs one block (the backbone's
                :meth:`DenseBackbone.run_block`: gradient checkpointing, per-block arguments).
        """
        tokens, hw = self.patch_embed(x)
        for block in self.blocks:
            tokens = run_block(block, tokens, hw)
        return (tokens if self.norm is None else self.norm(tokens)), hw


class DenseBackbone(CheckpointProtocol, BaseModule):
    """Base of the four backbones: presets, the mmdet surface, the stage loop, checkpoints.

    A subclass sets ``arch_zoo``, its facts (``attention_ops``, ``crop_pct``) and
    (optionally) ``arch_defaults``, ``numbered_layout``, ``checkpoint_filter``,
    ``derived_tensors`` and ``resize_checkpoint_tensor``. Its ``__init__`` takes its own
    arguments and passes the standard ones below on (``**kwargs``) to this ``__init__``;
    it resolves its arch (:meth:`resolve_arch`), validates its own arguments, calls
    :meth:`init_stages` and ends with :meth:`build_stages`, giving it a function that
    builds one :class:`Stage`. It may override :meth:`check_input`, :meth:`run_block` and
    :meth:`finish_stage`.

    Args:
        out_indices (Sequence[int]): Stages (0-based) whose outputs are returned as NCHW
            maps, each after its output norm (``norm{i}``, or the stage's own norm). Stages
            after the last index are not built (they would receive no gradient).
            Default: (0, 1, 2, 3).
        frozen_stages (int): -1 freezes nothing; 0 freezes the first patch embedding;
            ``i >= 1`` freezes stages 1..i (patch embedding, blocks and their norms).
            Default: -1.
        norm_eval (bool): Keep BatchNorm layers in eval mode while training (running
            statistics frozen). Default: False.
        with_cp (bool): Gradient checkpointing per block, saving memory. Default: False.
        compile_blocks (bool | dict): ``torch.compile`` each block on its own: True with torch.compile's
            defaults (Inductor), or a dict of its keyword arguments (``mode``, ``backend``, ``dynamic``,
            ``options``); the embeddings, norms and heads stay eager. Where compilation cannot run, one
            warning line says why and the blocks run eager (:mod:`~visattn_mm.models.block_compile`).
            Default: False.
        cuda_graphs (bool): Replay the training forward and backward as CUDA graphs, for the first
            training input size (fixed crops, such as UperNet's); other sizes, evaluation, other devices
            and steps drawn on the host (ViL's random shift) run eager, each saying so once
            (:mod:`~visattn_mm.models.cuda_graphs`). Not with ``compile_blocks``. Default: False.
        pretrained (str, optional): Deprecated, use ``init_cfg``.
        init_cfg (dict | list[dict], optional): ``dict(type='Pretrained', checkpoint=PATH,
            allow_partial=False)`` loads through :func:`load_pretrained` (official
            layouts converted, a report logged, loads matching under 90% refused);
            other mmengine init configs may be listed with it.
    """

    #: Preset name (and alias) -> dict of per-stage lists (``depths``, ``embed_dims``, ...).
    arch_zoo = {}
    #: Keys a custom arch dict must have.
    arch_required = ('depths', 'embed_dims', 'num_heads')
    #: Optional per-stage arch keys -> default (one value for every stage, or a tuple).
    arch_defaults = {}
    #: The specs (:mod:`visattn_mm.ops.specs`) of the attention ops of the default stages: the build
    #: log and the environment report say what ``'auto'`` runs for each.
    attention_ops = ()
    #: Centre-crop fraction of the paper's ImageNet evaluation (timm's ``crop_pct``).
    crop_pct = 0.875
    #: Where the numbered layout's keys go (``{i}`` 0-based): ``patch_embed``, ``block`` and
    #: ``norm`` -> format strings; empty if the backbone never had that layout.
    numbered_layout = {}

    def __init__(
        self,
        *,
        out_indices=(0, 1, 2, 3),
        frozen_stages=-1,
        norm_eval=False,
        with_cp=False,
        compile_blocks=False,
        cuda_graphs=False,
        pretrained=None,
        init_cfg=None,
        **unknown,
    ):
        name = type(self).__name__
        if unknown:
            # Python would name DenseBackbone.__init__, where the user wrote the backbone's name.
            raise TypeError(f'{name}.__init__() got an unexpected keyword argument {next(iter(unknown))!r}')
        if pretrained is not None:
            if init_cfg is not None:
                raise ValueError(f'{name}: set init_cfg or pretrained, not both')
            warnings.warn(
                f'{name}: `pretrained` is deprecated; use init_cfg=dict(type="Pretrained", checkpoint=...)',
                DeprecationWarning,
            )
            init_cfg = dict(type='Pretrained', checkpoint=pretrained)
        super().__init__(init_cfg=init_cfg)
        self._register_load_state_dict_pre_hook(self._adapt_loaded_state_dict)
        # out_indices and frozen_stages are checked against the arch's stages in init_stages.
        self.out_indices = out_indices
        self.frozen_stages = frozen_stages
        self.norm_eval = norm_eval
        self.with_cp = with_cp
        options = check_compile_option(compile_blocks, name)
        self.block_compiler = None if options is None else BlockCompiler(name, options)
        graphed = check_cuda_graphs_option(cuda_graphs, name, compile_blocks)
        self.graphs = GraphedForward(name) if graphed else None

    @classmethod
    def resolve_arch(cls, arch):
        """The arch as a dict with every per-stage key: a preset, or a checked custom dict.

        Raises:
            ValueError: For an unknown preset, a custom dict missing required keys,
                per-stage entries of the wrong length, ``embed_dims`` not divisible by
                ``num_heads``, or ``mlp_ratios`` giving no hidden units.
        """
        name = cls.__name__
        spec = check_arch(arch, cls.arch_zoo, cls.arch_required, name)
        num_stages = len(spec['depths'])
        for key, default in cls.arch_defaults.items():
            spec.setdefault(key, default if isinstance(default, tuple) else (default,) * num_stages)
        check_stage_lengths(name, num_stages, **{k: spec[k] for k in spec if k != 'depths'})
        for i, (dim, heads) in enumerate(zip(spec['embed_dims'], spec['num_heads'])):
            if dim % heads:
                raise ValueError(f'{name}: embed_dims[{i}]={dim} is not divisible by num_heads[{i}]={heads}')
        for i, ratio in enumerate(spec.get('mlp_ratios', ())):
            check_mlp_ratio(ratio, f'mlp_ratios[{i}]', name, spec['embed_dims'][i])
        return spec

    def init_stages(self, in_channels, depths, embed_dims, drop_path_rate, strides=None):
        """Check the standard arguments against the arch and store the stage facts; return the
        stochastic depth of every block.

        Args:
            in_channels (int): Input image channels.
            depths (Sequence[int]): Blocks per stage, of the whole arch.
            embed_dims (Sequence[int]): Channels per stage.
            drop_path_rate (float): Stochastic depth of the last block (linear from 0).
            strides (Sequence[int], optional): Output stride per stage. Default: the
                pyramid's 4, 8, 16, 32.

        Returns:
            list[list[float]]: Drop-path rate of every block, stage by stage, of the whole arch.
        """
        name = type(self).__name__
        num_stages = len(depths)
        check_int(in_channels, 'in_channels', name)
        self.out_indices = check_stage_args(name, num_stages, self.out_indices, self.frozen_stages, drop_path_rate)
        # Stages after the last output would receive no gradient: they are not built.
        self.num_stages = max(self.out_indices) + 1
        self.embed_dims = tuple(embed_dims[: self.num_stages])
        strides = strides or [4 * 2**i for i in range(num_stages)]
        self.strides = tuple(strides[: self.num_stages])
        self.in_channels = in_channels
        self.stages = nn.ModuleList()
        rates = linear_drop_path_rates(drop_path_rate, depths)
        starts = [sum(depths[:i]) for i in range(num_stages + 1)]
        return [rates[starts[i] : starts[i + 1]] for i in range(num_stages)]

    def build_stages(self, make_stage, init, output_norm=None):
        """Builds the body after :meth:`init_stages`: every built stage, the output norms, the random init,
        the frozen stages.

        Args:
            make_stage (callable): ``(i, in_dim) -> Stage``: stage ``i`` (0-based) on ``in_dim`` input
                channels (the image's for the first stage, the previous stage's after).
            init (callable): Applied to every module (``self.apply``) once all are built.
            output_norm (callable, optional): ``dim -> nn.Module``, the output norm ``norm{i}`` of every
                stage in ``out_indices``; None for a backbone whose stages end in their own norm.
        """
        for i in range(self.num_stages):
            self.stages.append(make_stage(i, self.embed_dims[i - 1] if i else self.in_channels))
        if output_norm is not None:
            for i in self.out_indices:
                self.add_module(f'norm{i}', output_norm(self.embed_dims[i]))
        self.apply(init)
        self._freeze_stages()
        if self.block_compiler is not None:
            for i, stage in enumerate(self.stages):
                for j, block in enumerate(stage.blocks):
                    self.block_compiler.add(block, f'stage{i}_block{j}')

    def stage_modules(self, i):
        """The modules of stage ``i`` (0-based): the stage, then its output norm if it has one."""
        norm = self.output_norm(i)
        return (self.stages[i],) if norm is None else (self.stages[i], norm)

    def output_norm(self, i):
        """The LayerNorm that turns stage ``i``'s tokens into its output map, or None."""
        return getattr(self, f'norm{i}', None)

    def check_input(self, x):
        """Raise a ValueError for an NCHW batch this backbone cannot run (default: any runs)."""

    def run_block(self, block, tokens, hw, *args):
        """``block(tokens, hw, *args)``, recomputed in backward under ``with_cp`` while training, compiled
        under ``compile_blocks``."""
        if self.block_compiler is not None:
            return self.block_compiler.run(block, tokens, hw, *args, with_cp=self.with_cp)
        return call_block(block, tokens, hw, *args, with_cp=self.with_cp)

    def finish_stage(self, i, tokens):
        """Stage ``i``'s tokens (after its stage norm, if any) as the next stage reads them (default: as
        they are)."""
        return tokens

    def iter_stages(self, x):
        """Run the built stages in turn on an NCHW batch (the classifier's timm interface uses this).

        Yields:
            tuple: ``(i, tokens, (H, W))`` after stage ``i``: its ``(B, H*W, C)`` tokens as
            the next stage reads them, before the output norm.

        Raises:
            ValueError: If ``x`` is not 4-D, or :meth:`check_input` refuses it.
        """
        if x.dim() != 4:
            raise ValueError(f'{type(self).__name__} expects an NCHW image batch, got shape {tuple(x.shape)}')
        warn_once_on_cpu_fp16_autocast(x)
        self.check_input(x)
        image_size = x.shape[2:]
        for i, stage in enumerate(self.stages):
            tokens, hw = stage(x, self.run_block)
            tokens = self.finish_stage(i, tokens)
            yield i, tokens, hw
            x = tokens_to_map(tokens, hw)
        if self.block_compiler is not None:
            self.block_compiler.report(image_size)

    def output_map(self, i, tokens, hw):
        """Stage ``i``'s output: ``tokens`` through its output norm (if any) as an NCHW map."""
        norm = self.output_norm(i)
        return tokens_to_map(tokens if norm is None else norm(tokens), hw)

    def forward(self, x):
        if self.graphs is not None:
            return self.graphs.run(self, x, self.eager_forward)
        return self.eager_forward(x)

    def eager_forward(self, x):
        """The output maps of ``out_indices`` for an NCHW batch, op by op (what ``cuda_graphs`` captures)."""
        return tuple(self.output_map(i, tokens, hw) for i, tokens, hw in self.iter_stages(x) if i in self.out_indices)

    def static_step_blocker(self):
        """Why a training step is not the same GPU work at every call (so not one CUDA graph), or None."""
        return None

    def get_layer_depth(self, param_name, prefix=''):
        """The layer a parameter belongs to, for layer-wise learning-rate decay (mmpretrain's
        ``get_layer_depth`` form, which its layer-decay constructor and ours,
        :class:`visattn_mm.engine.LayerDecayOptimWrapperConstructor`, call).

        Layer 0 is the first patch embedding; block ``j`` of stage ``i`` is layer
        ``sum(blocks of stages < i) + j + 1``; a later stage's patch embedding joins its first
        block, a stage norm or output norm its stage's last block (as the timm classifiers'
        ``group_matcher`` groups them); anything else, e.g. the neck and heads, is the last layer,
        ``num_layers - 1``, whose learning rate is not decayed.

        Args:
            param_name (str): A parameter's name, e.g. ``'backbone.stages.1.blocks.0.attn.qkv.weight'``.
            prefix (str): The backbone's prefix in ``param_name`` (e.g. ``'backbone.'``).

        Returns:
            tuple[int, int]: The layer depth and the number of layers (blocks + 2).
        """
        depths = [len(stage.blocks) for stage in self.stages]
        num_layers = sum(depths) + 2
        name = param_name[len(prefix) :] if param_name.startswith(prefix) else None
        found = re.match(r'stages\.(\d+)\.(patch_embed|blocks\.(\d+)|norm)\.|norm(\d+)\.', name or '')
        if found is None:
            return num_layers - 1, num_layers
        stage, part, block, output_norm = found.groups()
        if output_norm is not None:
            return sum(depths[: int(output_norm) + 1]), num_layers
        before = sum(depths[: int(stage)])
        if part == 'patch_embed':
            return (0 if stage == '0' else before + 1), num_layers
        if block is not None:
            return before + int(block) + 1, num_layers
        return before + depths[int(stage)], num_layers  # the stage norm

    def truncate(self, num_stages, keep_output_norms=True):
        """Delete the stages after the first ``num_stages`` (and, optionally, all output norms).

        For models that use only early stages (timm's ``features_only`` pruning);
        parameters they would never use would otherwise get no gradient.
        """
        del self.stages[num_stages:]
        doomed = range(self.num_stages) if not keep_output_norms else range(num_stages, self.num_stages)
        for i in doomed:
            if self.output_norm(i) is not None:
                delattr(self, f'norm{i}')
        if not keep_output_norms:
            self.out_indices = ()
        self.num_stages = num_stages
        self.out_indices = tuple(i for i in self.out_indices if i < num_stages)
        self.embed_dims, self.strides = self.embed_dims[:num_stages], self.strides[:num_stages]
        self.frozen_stages = min(self.frozen_stages, num_stages)

    def _adapt_loaded_state_dict(self, state_dict, prefix, *args):
        # Every load path (init_cfg, load_from, resume, load_state_dict) renames the numbered
        # layout, drops derived tensors and resizes tables; the loader has done so already
        # for its own loads.
        self.adapt_state_dict(state_dict, prefix)

    def adapt_state_dict(self, state_dict, prefix='', report=None):
        """Rename the numbered layout (:func:`rename_numbered_stage_keys`), then as the protocol does."""
        rename_numbered_stage_keys(state_dict, self.numbered_layout, prefix, report)
        super().adapt_state_dict(state_dict, prefix, report)

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
                raise TypeError(
                    f'{type(self).__name__}: init_cfg must be a dict or a list of dicts, '
                    f"each with a type, e.g. dict(type='Pretrained', checkpoint=PATH); "
                    f'got {entry!r}'
                )
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
        frozen = [self.stages[0].patch_embed] if self.frozen_stages >= 0 else []
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


_STAGE_KEY = re.compile(r'(?:stages\.|norm)(\d+)\.')  # stages.{i}.*, norm{i}.*
_NUMBERED_KEY = re.compile(r'(patch_embed|block|norm)(\d+)\.')


def rename_numbered_stage_keys(state_dict, layout, prefix='', report=None):
    """Rename, in place, the keys of a state_dict in the numbered layout to the stage layout.

    The numbered layout is the official VVT code's (``patch_embed{n}.``, ``block{n}.{j}.``,
    ``norm{n}.``, ``n`` 1-based), which VVT and Pale checkpoints used before the four
    backbones shared :class:`Stage`. A state_dict is in it if it has a ``patch_embed{n}.``
    key under ``prefix``; then every ``{part}{n}.`` key under ``prefix`` becomes
    ``layout[part].format(i=n - 1) + '.'``. A state_dict in the stage layout has no such
    key, so it is left as it is.

    Args:
        state_dict (dict): Checkpoint tensors, keyed as in the model holding the backbone.
        layout (dict): ``'patch_embed'``, ``'block'``, ``'norm'`` -> new prefix format
            (a backbone's ``numbered_layout``); empty: nothing to rename.
        prefix (str): The backbone's prefix in ``state_dict`` (e.g. ``'backbone.'``).
        report (LoadReport, optional): Each rename is noted in ``report.renamed``.
    """
    if not layout or not any(
        key.startswith(prefix) and (match := _NUMBERED_KEY.match(key, len(prefix))) and match.group(1) == 'patch_embed'
        for key in state_dict
    ):
        return
    renamed = {}  # set after all pops: Pale's norm{n} -> norm{n-1} would overwrite a key not yet renamed
    for key in list(state_dict):
        new = renamed_numbered_key(key, layout, prefix)
        if new is not None:
            renamed[new] = state_dict.pop(key)
            if report is not None:
                report.renamed[new] = key
    state_dict.update(renamed)


def renamed_numbered_key(key, layout, prefix=''):
    """``key``'s stage-layout name if it is a numbered-layout key of a part in ``layout``, else None.

    Only the key itself is looked at: :func:`rename_numbered_stage_keys` decides whether a
    state_dict is in the numbered layout at all.
    """
    match = _NUMBERED_KEY.match(key, len(prefix)) if key.startswith(prefix) else None
    if match is None or match.group(1) not in layout:
        return None
    return prefix + layout[match.group(1)].format(i=int(match.group(2)) - 1) + '.' + key[match.end() :]


def drop_head_and_unbuilt_stages(state_dict, target_keys, report, other_reason=None):
    """The common part of the backbones' checkpoint filters.

    Drops, with the reason in ``report``, the classification ``head`` and the tensors of
    stages the model does not build (``stages.{i}.*`` and ``norm{i}.*`` after the last
    ``out_indices``).

    Args:
        state_dict (dict): Checkpoint tensors, under the model's names.
        target_keys (set[str]): The model's keys.
        report (LoadReport): Where the drops are noted.
        other_reason (callable, optional): ``key -> reason or None``: further tensors to drop.

    Returns:
        dict: The tensors kept.
    """
    built = {int(m.group(1)) for m in map(_STAGE_KEY.match, target_keys) if m}
    out = {}
    for key, value in state_dict.items():
        match = _STAGE_KEY.match(key)
        if key.startswith('head.'):
            report.dropped[key] = 'classification head'
        elif match and int(match.group(1)) not in built:
            report.dropped[key] = 'stage not built (after the last out_indices)'
        elif other_reason is not None and other_reason(key):
            report.dropped[key] = other_reason(key)
        else:
            out[key] = value
    return out
