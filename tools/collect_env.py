"""Print the environment: system, PyTorch and CUDA, GPUs, mmcv and its compiled ops,
the OpenMMLab libraries, timm, and the attention path each backbone takes here.

Usage::

    python tools/collect_env.py

Paste its output into bug reports; ``tools/train.py`` logs the same at start.
"""

from visattn_mm.env_report import collect_env, format_env


def main():
    print(format_env(collect_env()))


if __name__ == '__main__':
    main()
