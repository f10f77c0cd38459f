# Pale Transformer backbone for dense prediction (Pale paper, Table 1): every stage output.
# Final configs add the size: `dict(_base_.pale_backbone, arch=..., drop_path_rate=..., init_cfg=...)`.
# Paper recipe (Pale paper, appendix "Detailed Experimental Settings"): detection drop path
# 0.2 (T) / 0.3 (S) / 0.5 (B), weight decay 0.001 (T, S) / 0.05 (B); segmentation drop path
# 0.3 / 0.3 / 0.5 with the shared UperNet recipe. Not stated in the paper, our choices: no
# gradient clipping (CSWin/Swin Mask R-CNN 1x configs), and RetinaNet and 3x+MS (no Pale paper
# numbers) use the Mask R-CNN 1x recipe.
# No official Pale weights exist: the ImageNet checkpoint is a Classifier(backbone_type=
# "PaleTransformer") / timm-format checkpoint of your own (tools/timm_train.py).
pale_backbone = dict(
    _delete_=True,
    type='PaleTransformer',
    out_indices=(0, 1, 2, 3),
    frozen_stages=-1,
    norm_eval=False,
    with_cp=False,
    # 'auto', 'fast', 'math' or 'triton': what each runs, visattn_mm/ops/impl.py
    attn_impl='auto',
)
