# RetinaNet + FPN as in mmdet's Swin/PVT RetinaNet configs: the backbone gives strides 8/16/32
# (out_indices=(1, 2, 3)), the FPN uses all of them (start_level=0) and builds P6/P7 from the
# last backbone output ('on_input'), so no output goes unused. Final configs replace the
# backbone (keeping out_indices=(1, 2, 3)) and the neck's input channels (last three stage dims).
_base_ = ['mmdet::_base_/models/retinanet_r50_fpn.py']
model = dict(
    backbone=dict(out_indices=(1, 2, 3)),  # placeholder (ResNet-50) until a final config replaces it
    neck=dict(in_channels=[512, 1024, 2048], start_level=0, add_extra_convs='on_input', num_outs=5),
)
