"""Run timm's own train.py (or validate.py) with the visattn_mm model names registered.

timm's scripts are not part of the pip package: pass the path of train.py from a
checkout of huggingface/pytorch-image-models, then its usual arguments, e.g.

    python tools/timm_train.py PATH/TO/pytorch-image-models/train.py /data/imagenet --model pale_tiny ...
"""

import runpy
import sys

import visattn_mm  # noqa: F401  (registers vil_*, vil_ls_*, vvt_*, pale_* with timm)

if __name__ == '__main__':
    if len(sys.argv) < 2 or not sys.argv[1].endswith('.py'):
        sys.exit('usage: python tools/timm_train.py PATH/TO/timm/train.py [timm train.py arguments]')
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name='__main__')
