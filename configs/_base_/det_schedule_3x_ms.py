# COCO 3x + multi-scale for the detectors (ViL paper, Appendix A.2 and Table 10): 36 epochs, steps
# at 27 and 33, same optimiser and warm-up as 1x. The detector bases swap their training
# Resize for `multiscale_resize`: shorter side drawn from {640, 672, ..., 800}, longer side at
# most 1333, no crop. Testing stays single scale (1333, 800).
_base_ = ['./det_schedule_1x.py']

train_cfg = dict(max_epochs=36)
param_scheduler = [
    _base_.param_scheduler[0],  # the 1x warm-up
    dict(type='MultiStepLR', begin=0, end=36, by_epoch=True, milestones=[27, 33], gamma=0.1),
]
multiscale_resize = dict(
    type='RandomChoiceResize', scales=[(1333, short) for short in range(640, 801, 32)], keep_ratio=True
)
