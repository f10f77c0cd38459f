# ViL and ViL-LS backbones for dense prediction in the official detection layout
# (docs/backbones.md#vil-layouts; ViL paper, Sec. 4.3 and Appendix C): sliding-chunk attention
# in all four stages (ViL-LS: long-short in stages 1-2), window 7, masking mode 0 ("sliding
# chunk without padding"), global tokens 1,1,1,0, every stage output.
# Final configs take a size of `sizes` (ViL) or `ls_sizes` (ViL-LS) below:
# `model = dict(backbone=_base_.sizes.s.backbone, neck=dict(in_channels=_base_.sizes.s.dims))`;
# RetinaNet also sets out_indices=(1, 2, 3) and takes dims[1:].
# Per size (ViL paper Table 10, upper ends): drop path 0.1 (T), 0.2 (S), 0.3 (M, B); Base
# uses lr 8e-5 (`det_optim_wrapper` below). The ViL paper has no segmentation recipe: UperNet uses
# the shared ADE20K recipe with these drop-path values.
# ViL-LS has no paper dense-prediction numbers or recipe (the Transformer-LS paper leaves dense
# prediction to future work, Sec. 5): it uses ViL's recipe for the same size (drop path,
# gradient clipping, schedules).
vil_backbone = dict(
    _delete_=True,
    type='ViL',
    window_size=7,
    masking_mode=0,
    out_indices=(0, 1, 2, 3),
    frozen_stages=-1,
    norm_eval=False,
    with_cp=False,
    # 'auto', 'fast', 'math' or 'triton': what each runs, visattn_mm/ops/impl.py
    attn_impl='auto',
)
# dynamic projection rank 8 (Transformer-LS paper, Sec. 4.3)
vil_ls_backbone = dict(vil_backbone, type='ViLLS', dp_rank=8)
# Per size: the backbone (drop path as above, the ImageNet checkpoint) and its four stage dims, the
# input channels of the neck or decode head.
sizes = {
    size: dict(
        backbone=dict(
            vil_backbone,
            arch=arch,
            drop_path_rate=drop_path,
            init_cfg=dict(type='Pretrained', checkpoint=f'checkpoints/vil_{arch}.pth'),
        ),
        dims=dims,
    )
    for size, arch, drop_path, dims in [
        ('t', 'tiny', 0.1, [48, 96, 192, 384]),
        ('s', 'small', 0.2, [96, 192, 384, 768]),
        ('m', 'medium', 0.3, [96, 192, 384, 768]),
        ('b', 'base', 0.3, [96, 192, 384, 768]),
    ]
}
ls_sizes = {
    size: dict(
        dims=vil['dims'],
        backbone=dict(
            vil['backbone'],
            **vil_ls_backbone,
            init_cfg=dict(type='Pretrained', checkpoint=f"checkpoints/vil_ls_{vil['backbone']['arch']}.pth"),
        ),
    )
    for size, vil in sizes.items()
}
# The detection optimiser per detector and size, over the schedule bases' AdamW: gradient clipping
# at global norm 0.5 for Mask R-CNN (the official detectron2 Mask R-CNN configs) and 1 for RetinaNet
# (ViL paper Table 10), and Base's lr 8e-5 (Table 10); ViL-LS takes ViL's. A final detection config
# takes its own: `optim_wrapper = _base_.det_optim_wrapper.maskrcnn.s`.
det_optim_wrapper = {
    detector: {
        size: dict(clip_grad=dict(max_norm=max_norm, norm_type=2), **optimizer)
        for size, optimizer in [('t', {}), ('s', {}), ('m', {}), ('b', dict(optimizer=dict(lr=8e-5)))]
    }
    for detector, max_norm in [('maskrcnn', 0.5), ('retinanet', 1.0)]
}
