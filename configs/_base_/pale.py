# Pale Transformer backbone for dense prediction (Pale paper, Table 1): every stage output.
# Final configs take a size of `sizes` below: `model = dict(backbone=_base_.sizes.s.backbone,
# neck=dict(in_channels=_base_.sizes.s.dims))`; RetinaNet also sets out_indices=(1, 2, 3).
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
# Per size: the backbone (the detection drop path, the ImageNet checkpoint) and its four stage dims,
# the input channels of the neck or decode head.
sizes = {
    size: dict(
        backbone=dict(
            pale_backbone,
            arch=arch,
            drop_path_rate=drop_path,
            init_cfg=dict(type='Pretrained', checkpoint=f'checkpoints/pale_{arch}.pth'),
        ),
        dims=dims,
    )
    for size, arch, drop_path, dims in [
        ('t', 'tiny', 0.2, [64, 128, 256, 512]),
        ('s', 'small', 0.3, [96, 192, 384, 768]),
        ('b', 'base', 0.5, [128, 256, 512, 1024]),
    ]
}
# The detection optimiser per detector and size, over the schedule bases' AdamW (weight decay
# 0.05): the paper's weight decay 0.001 for T and S (B keeps 0.05), no gradient clipping, the same
# for both detectors (see above). A final detection config takes its own:
# `optim_wrapper = _base_.det_optim_wrapper.maskrcnn.s`.
det_optim_wrapper = {
    detector: {size: dict(optimizer=dict(weight_decay=0.001)) if size != 'b' else {} for size in sizes}
    for detector in ('maskrcnn', 'retinanet')
}
