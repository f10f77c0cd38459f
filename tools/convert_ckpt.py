"""Convert an ImageNet checkpoint (official ViL/ViL-LS, ours, mmengine) for a dense backbone.

    python tools/convert_ckpt.py SRC DST --config configs/maskrcnn_vil_s_1x.py
    python tools/convert_ckpt.py SRC DST --backbone type=ViL arch=small

The backbone is built from the config's ``model.backbone`` (or the given dict),
the checkpoint is loaded into it exactly as ``init_cfg=dict(type='Pretrained')``
would load it, the load report is printed, and the tensors that came from the
checkpoint (converted and resized for this backbone) are written to DST as a
plain, weights-only file: ``{'state_dict': ..., 'meta': {...}}``.
"""

import argparse
import logging
import os
import os.path as osp

import torch
from mmengine.config import Config, DictAction
from mmengine.registry import MODELS

import visattn_mm  # noqa: F401  (registers the backbones)
from visattn_mm import cli as common
from visattn_mm.checkpoint import load_pretrained

CONVERT_ADVICE = (
    'is it a checkpoint of another backbone or size? Pass --allow-partial to write the tensors that match anyway.'
)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('src', help='checkpoint to convert')
    parser.add_argument('dst', help='where to write the converted weights')
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument('--config', help='a config whose model.backbone is the target')
    target.add_argument(
        '--backbone',
        nargs='+',
        action=DictAction,
        help='the target backbone as key=value pairs, e.g. type=ViL arch=small',
    )
    parser.add_argument(
        '--allow-partial', action='store_true', help='write the file even if under 90%% of the backbone was matched'
    )
    args = parser.parse_args()

    backbone_cfg = dict(Config.fromfile(args.config).model.backbone if args.config else args.backbone)
    backbone_cfg.pop('init_cfg', None)
    backbone = MODELS.build(backbone_cfg)

    quiet = logging.getLogger('visattn_mm.convert_ckpt')
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    with common.exit_on_checkpoint_error():
        report = load_pretrained(
            backbone, args.src, allow_partial=args.allow_partial, logger=quiet, advice=CONVERT_ADVICE
        )
    print(report.summary(max_keys=40))

    from_checkpoint = set(report.loaded) | set(report.converted) | set(report.resized)
    state_dict = {k: v for k, v in backbone.state_dict().items() if k in from_checkpoint}
    meta = dict(
        source=osp.abspath(args.src), layout=report.layout, container=report.container, backbone=str(backbone_cfg)
    )
    os.makedirs(osp.dirname(osp.abspath(args.dst)), exist_ok=True)
    torch.save({'state_dict': state_dict, 'meta': meta}, args.dst)
    print(f'wrote {len(state_dict)} tensors to {args.dst}')


if __name__ == '__main__':
    main()
