# Parameters trained without weight decay, in every config (the papers' AdamW recipes, as in
# mmdet/mmseg's Swin configs): norms by module type (so ViL-LS's `dual_ln_*` LayerNorms and
# Pale's BatchNorms are caught whatever their names), biases, and by name the position tables
# and tokens: ViL/ViL-LS RPB tables and global-token biases (`*relative_position*`), global
# tokens (`cls_token`) and absolute position embeddings (`*pos_embed`).
# Used by the schedule bases as `paramwise_cfg=_base_.no_decay_paramwise_cfg`.
no_decay_paramwise_cfg = dict(
    norm_decay_mult=0.0,
    bias_decay_mult=0.0,
    custom_keys={
        'relative_position': dict(decay_mult=0.0),
        'cls_token': dict(decay_mult=0.0),
        'pos_embed': dict(decay_mult=0.0),
    },
)
# The optimizer-wrapper constructor of every config: mmengine's default with the parameter groups
# as plain dicts, so that `compile=True` can trace the optimizer step (visattn_mm/engine/optim_constructor.py).
optim_wrapper_constructor = 'PlainGroupsOptimWrapperConstructor'
