"""The backbones the benchmark tools build by name: ours (each family's sizes) and the baselines Swin-T and
ResNet-50, the loss of a backbone's step, and the step the Triton tools compile and time.

``tools/analysis/benchmark.py``, ``step_cost_report.py``, ``profile_step.py``, ``step_time_calibration.py``,
``step_cost_calibration.py``, ``decide_cuda_defaults.py``, ``triton_resources.py`` and ``triton_tuning.py`` name
their models by the keys of :data:`MODEL_ZOO` (or :data:`COMPARED_MODELS`), so that a row of one tool's output
means the same model in every other.
"""

from __future__ import annotations

import functools

import torch

from visattn_mm.analysis import benchmarking
from visattn_mm.models import FAMILIES, VVT

# mmdet's Mask R-CNN Swin-T backbone (configs/swin/mask-rcnn_swin-t-p4-w7_fpn_1x_coco.py)
# and ResNet-50 backbone (configs/_base_/models/mask-rcnn_r50_fpn.py), without weights.
SWIN_T = dict(
    embed_dims=96,
    depths=(2, 2, 6, 2),
    num_heads=(3, 6, 12, 24),
    window_size=7,
    mlp_ratio=4,
    qkv_bias=True,
    qk_scale=None,
    drop_rate=0.0,
    attn_drop_rate=0.0,
    drop_path_rate=0.2,
    patch_norm=True,
    out_indices=(0, 1, 2, 3),
    with_cp=False,
)
RESNET_50 = dict(
    depth=50,
    num_stages=4,
    out_indices=(0, 1, 2, 3),
    frozen_stages=1,
    norm_cfg=dict(type='BN', requires_grad=True),
    norm_eval=True,
    style='pytorch',
)


def _ours(class_name, arch, **kwargs):
    import visattn_mm.models as models

    return getattr(models, class_name)(arch=arch, **kwargs)


def _timm_swin_t():
    """timm's Swin-T as a dense backbone: any input size (padded like mmdet's Swin), 4 maps."""
    import timm
    from timm.layers import PatchEmbed

    model = timm.create_model(
        'swin_tiny_patch4_window7_224',
        features_only=True,
        strict_img_size=False,
        drop_path_rate=SWIN_T['drop_path_rate'],
    )
    for module in model.modules():
        if isinstance(module, PatchEmbed):
            module.dynamic_img_pad = True
    return model


def _torchvision_resnet_50():
    """torchvision's ResNet-50 trunk returning the four stage maps."""
    import torchvision
    from torchvision.models.feature_extraction import create_feature_extractor

    return create_feature_extractor(torchvision.models.resnet50(), [f'layer{i}' for i in range(1, 5)])


def _baseline(class_name, kwargs, fallback, fallback_name):
    """mmdet's backbone ``class_name``; where mmdet (or mmcv's compiled ops) cannot be
    imported, as on a GPU host with only torch and timm, the same architecture from
    ``fallback``, announced on stdout."""
    try:
        import mmdet.models.backbones as backbones
    except Exception as error:  # ImportError, or mmcv's _ext failing to load
        print(
            f'[benchmark] mmdet cannot be imported ({type(error).__name__}: {error}); '
            f'{class_name} baseline built from {fallback_name} instead',
            flush=True,
        )
        return fallback()
    return getattr(backbones, class_name)(**kwargs)


#: The name suffix of VVT with ``fused_conv_gelu=True``: its opt-in kernels run on CUDA only, so ``--models all``
#: leaves these out.
FUSED = '-fused'


def _model_zoo():
    """name -> (builder, uses our attention ops)."""
    zoo = {}
    for family in FAMILIES:
        for size in family.sizes:
            name, class_name = family.model_name(size), family.cls.__name__
            zoo[name] = (functools.partial(_ours, class_name, size), True)
            if family.cls is VVT:  # its opt-ins: bf16 products (unlike fp32 ones in bf16 rows), fused conv-FFN
                zoo[f'{name}-bf16'] = (functools.partial(_ours, class_name, size, bf16_products=True), True)
                zoo[name + FUSED] = (functools.partial(_ours, class_name, size, fused_conv_gelu=True), True)
    zoo['swin-t'] = (
        functools.partial(_baseline, 'SwinTransformer', SWIN_T, _timm_swin_t, "timm's swin_tiny_patch4_window7_224"),
        False,
    )
    zoo['r50'] = (
        functools.partial(_baseline, 'ResNet', RESNET_50, _torchvision_resnet_50, "torchvision's resnet50"),
        False,
    )
    return zoo


MODEL_ZOO = _model_zoo()


def backbone_loss(outputs):
    """Sum of the means of the backbone's output maps (a scalar depending on all of them)."""
    if isinstance(outputs, dict):  # torchvision's feature extractor
        outputs = outputs.values()
    return sum(out.float().mean() for out in outputs)


def case_function(model, images, mode, device, dtype, cache_casts=True):
    """A no-argument callable running one forward (or forward + backward) of ``model``; ``cache_casts``:
    see :func:`~visattn_mm.analysis.benchmarking.autocast`."""
    if mode == 'fwd':
        model.eval()

        def forward():
            with torch.no_grad(), benchmarking.autocast(device, dtype, cache_casts):
                model(images)

        return forward
    model.train()

    def forward_backward():
        with benchmarking.autocast(device, dtype, cache_casts):
            loss = backbone_loss(model(images))
        loss.backward()
        model.zero_grad(set_to_none=True)

    return forward_backward


def build_backbone(name):
    """One of :data:`MODEL_ZOO`'s backbones; 'swin-t' as in the H100 measurements (timm's)."""
    if name == 'swin-t':
        return _timm_swin_t()
    return MODEL_ZOO[name][0]()


# Each family's size set beside Swin-T: (class name, arch) by the tools' name.
COMPARED_MODELS = {family.compared_model: (family.cls.__name__, family.compared_size) for family in FAMILIES}
# The dtypes the Triton tools compile (``triton_resources.py``) and time (``triton_tuning.py``) the kernels in.
TRITON_DTYPES = ('fp32', 'bf16')


def training_step(model, image, dtype):
    """Forward (under autocast for 'bf16') and backward of the sum of the output maps' means."""
    with benchmarking.autocast(image.device, dtype):
        outputs = model(image)
    sum(out.float().mean() for out in outputs).backward()
