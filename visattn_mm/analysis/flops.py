"""Build a config's model and count its parameters and FLOPs (multiply-adds).

What is counted is written in ``tools/analysis/model_zoo.py``'s docstring and in the page it generates
(``docs/model_zoo.md``); ``tools/analysis/get_flops.py`` counts one config at a size you name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


def build_model(config_path: str | Path, device: str = 'cpu', cfg_options: dict | None = None):
    """Build the config's model (with ``cfg_options`` applied) in eval mode, no weights loaded;
    returns (model, task scope)."""
    from mmengine.registry import MODELS, init_default_scope

    from visattn_mm import cli

    cli.import_plugin()
    cfg = cli.load_config(str(config_path), cfg_options, 'none')
    scope = cli.register_scope_modules(cfg)
    init_default_scope(scope)
    return MODELS.build(cfg.model).to(device).eval(), scope


def count_parameters(model) -> int:
    """Number of parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def _dummy_data_samples(scope: str, height: int, width: int) -> list:
    """One data sample with the image metadata the tensor-mode forward reads."""
    meta = dict(
        img_shape=(height, width),
        ori_shape=(height, width),
        pad_shape=(height, width),
        batch_input_shape=(height, width),
        scale_factor=(1.0, 1.0),
    )
    if scope == 'mmdet':
        from mmdet.structures import DetDataSample

        return [DetDataSample(metainfo=meta)]
    from mmseg.structures import SegDataSample

    return [SegDataSample(metainfo=meta)]


def _module_macs(counter, model) -> dict[str, int]:
    """Multiply-adds per top-level submodule (``backbone``, ``neck``, heads).

    A submodule whose ``forward`` the model calls as a plain method (mmdet's
    ``roi_head.forward``, mmseg's ``decode_head.forward``) has no entry of its
    own: its outermost called descendants are summed instead.
    """
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(model).__name__

    def outermost(name: str, prefix: str) -> bool:
        parts = name.split('.')
        ancestors = ('.'.join(parts[:i]) for i in range(prefix.count('.') + 1, len(parts)))
        return not any(a in counts for a in ancestors)

    parts = {}
    for child, _ in model.named_children():
        prefix = f'{root}.{child}'
        parts[child] = (
            sum(v for k, v in counts.items() if (k == prefix or k.startswith(prefix + '.')) and outermost(k, prefix))
            // 2
        )
    return {k: v for k, v in parts.items() if v}


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of one fused attention call, as torch counts its CUDA kernels."""
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _flop_counter():
    """A ``FlopCounterMode`` that also counts the CPU flash-attention kernel.

    torch counts ``scaled_dot_product_attention`` only through its CUDA kernels;
    on CPU it dispatches to ``_scaled_dot_product_flash_attention_for_cpu``,
    which the stock counter skips (the ViL, ViL-LS and Pale attention would
    count as zero). The CUDA kernels' formula is registered for it.
    """
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return FlopCounterMode(display=False, custom_mapping={cpu_flash: _sdpa_flops})


def count_macs(fn, *args, **kwargs) -> int:
    """Multiply-adds of convolutions and matrix products in ``fn(*args, **kwargs)``."""
    import torch

    with torch.no_grad(), _flop_counter() as counter:
        fn(*args, **kwargs)
    # FlopCounterMode counts 2 FLOPs per multiply-add; the papers count multiply-adds.
    return counter.get_total_flops() // 2


def count_flops(model, scope: str, height: int, width: int, seed: int = 0) -> tuple[int, dict[str, int]]:
    """Multiply-adds of one ``mode='tensor'`` forward on a random ``height x width`` image.

    Returns:
        The total and its split over the model's top-level submodules.
    """
    import torch

    inputs = torch.randn(1, 3, height, width, generator=torch.Generator().manual_seed(seed))
    inputs = inputs.to(next(model.parameters()).device)
    samples = _dummy_data_samples(scope, height, width)
    torch.manual_seed(seed)
    with torch.no_grad(), _flop_counter() as counter:
        model(inputs, samples, mode='tensor')
    return counter.get_total_flops() // 2, _module_macs(counter, model)


@dataclass
class Measurement:
    """What the tool measured for one config."""

    params: int | None = None
    flops: int | None = None
    flops_input: tuple[int, int] | None = None
    flops_parts: dict[str, int] | None = None
    seconds: float = 0.0


def measure(config_path: Path, skip_flops: bool, input_size: tuple[int, int], device: str = 'cpu') -> Measurement:
    """Parameters, and unless ``skip_flops`` FLOPs at ``input_size`` (H, W), of one config."""
    start = time.perf_counter()
    model, scope = build_model(config_path, device)
    result = Measurement(params=count_parameters(model))
    if not skip_flops:
        result.flops, result.flops_parts = count_flops(model, scope, *input_size)
        result.flops_input = input_size
    result.seconds = time.perf_counter() - start
    return result


def model_key(config_path: Path) -> str:
    """Text identifying the model a config builds (1x and 3x + MS configs share one)."""
    from mmengine.config import Config

    return repr(Config.fromfile(str(config_path)).model.to_dict())
