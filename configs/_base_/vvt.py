# VVT backbone for dense prediction (VVT paper, Sec. 4.3 and Table 1): every stage output, after
# the LayerNorm `stages.{i}.norm` that closes each stage (`norm{i+1}` in the official code,
# docs/backbones.md#official-checkpoint-layouts). Final configs take a size of `sizes` below:
# `model = dict(backbone=_base_.sizes.s.backbone, neck=dict(in_channels=_base_.sizes.s.dims))`.
# The VVT paper publishes no dense-prediction drop path or detection recipe: drop path 0.1 (T),
# 0.2 (S), 0.3 (M, L) and, for detection, gradient clipping at 1.0 (`det_optim_wrapper` below)
# are our choices.
# The official VVT ImageNet release (`model` container) loads as is.
vvt_backbone = dict(
    _delete_=True,
    type='VVT',
    out_indices=(0, 1, 2, 3),
    frozen_stages=-1,
    norm_eval=False,
    with_cp=False,
    # 'auto', 'fast', 'math' or 'triton': what each runs, visattn_mm/ops/impl.py
    attn_impl='auto',
    # True: the attention's matrix products on bf16 operands under bf16 AMP (tensor cores,
    # coarser gradients; see visattn_mm.ops.vicinity); False: fp32 products
    bf16_products=False,
)
# Per size: the backbone (drop path as above, the ImageNet checkpoint) and its four stage dims, the
# input channels of the neck or decode head.
sizes = {
    size: dict(
        backbone=dict(
            vvt_backbone,
            arch=arch,
            drop_path_rate=drop_path,
            init_cfg=dict(type='Pretrained', checkpoint=f'checkpoints/vvt_{arch}.pth'),
        ),
        dims=[96, 160, 320, 512],
    )
    for size, arch, drop_path in [('t', 'tiny', 0.1), ('s', 'small', 0.2), ('m', 'medium', 0.3), ('l', 'large', 0.3)]
}
# The detection optimiser per detector and size, over the schedule bases' AdamW: gradient clipping
# at global norm 1 for both detectors and every size (our choice, above). A final detection config
# takes its own: `optim_wrapper = _base_.det_optim_wrapper.maskrcnn.s`.
det_optim_wrapper = {
    detector: {size: dict(clip_grad=dict(max_norm=1.0, norm_type=2)) for size in sizes}
    for detector in ('maskrcnn', 'retinanet')
}
