# VVT backbone for dense prediction (VVT paper, Sec. 4.3 and Table 1): every stage output, after
# the LayerNorm `stages.{i}.norm` that closes each stage (`norm{i+1}` in the official code,
# docs/backbones.md#official-checkpoint-layouts). Final configs add the size:
# `dict(_base_.vvt_backbone, arch=..., drop_path_rate=..., init_cfg=...)`.
# The VVT paper publishes no dense-prediction drop path or detection recipe: drop path 0.1 (T),
# 0.2 (S), 0.3 (M, L) and, for detection, gradient clipping at 1.0 are our choices.
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
