"""The compiled code of each op's Triton kernels in this tree, one digest per op: a measured row of
the CUDA defaults table (:mod:`visattn_mm.ops.cuda_defaults`) whose recorded digest differs runs 'fast'.

Generated, not edited: ``.venv/bin/python tools/analysis/triton_resources.py --digests write`` compiles every
kernel launch of a training step of each backbone (256x256, fp32 and bf16 autocast) for sm_90 under
Triton 3.7.1 and digests each op's code without its debug lines (``op_digests``);
tests/test_ops/test_triton/test_triton_resources.py fails while this file is stale.
"""

TRITON = '3.7.1'
CAPABILITY = 90
KERNEL_DIGESTS = dict(
    sliding_chunk='575622ee435d',
    long_short='acb9efcbbf8b',
    pale='f1a6b7f8df7c',
    vicinity='d0210ce311bb',
)
