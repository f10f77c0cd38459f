"""The attention ops of this package, one spec each: the one table that lists them.

Whatever lists the ops derives from :data:`OP_SPECS`: the path choice (:mod:`visattn_mm.ops.impl`), the
CUDA defaults table (:mod:`visattn_mm.ops.cuda_defaults`), the backbones' ``attention_ops``, the
attention benchmark and the tests' parametrisation. ``tests/test_ops/test_op_specs.py`` fails for a
list of op names written anywhere else, and docs/design.md ("Adding an attention op") lists the places
a new op touches.
"""

from __future__ import annotations

import dataclasses

import torch

# Why the limits below are what they are (sm_90 compiles: docs/benchmarks_history.md, "Triton kernels: registers
# and spills"): chunks (segments) over 11 tokens a side need tiles of 256 slots, more shared memory than an H100's
# 227 KB; vicinity head dims over 64 (over 32 in float64 on a GPU) make a program's (4d x d) sums too large for it.
WINDOW_LIMIT_WHY = "larger tiles would not fit the GPU's shared memory"
HEAD_DIM_LIMIT_WHY = "a program's (4d x d) sums would not fit the GPU's shared memory"


@dataclasses.dataclass(frozen=True)
class TritonLimits:
    """What an op's Triton kernels cannot run (xformers' per-op limits); None: no limit.

    Args:
        max_window (int, optional): The largest chunk (segment) size, in tokens a side.
        max_head_dim (int, optional): The largest head dim, and
        max_gpu_float64_head_dim (int, optional): the largest in float64 on a GPU (Triton's
            interpreter has no shared memory to run out of).
    """

    max_window: int | None = None
    max_head_dim: int | None = None
    max_gpu_float64_head_dim: int | None = None

    def reason(self, q, window, dropout_p, interpreted):
        """What keeps the kernels from running a call, in words; None where nothing does.

        Args:
            q (torch.Tensor): The queries ``(..., N, head_dim)``.
            window (int, optional): The call's chunk (segment) size, where the op has one.
            dropout_p (float): The call's attention dropout (no kernel has it).
            interpreted (bool): Whether Triton's interpreter runs the kernels.
        """
        if dropout_p > 0:
            return f'the kernels do not support attention dropout (dropout_p={dropout_p})'
        if window is not None and self.max_window is not None and window > self.max_window:
            return (
                f'the kernels take windows of at most {self.max_window} tokens a side (window <= {self.max_window}: '
                f'tiles of 128 slots), got window={window}: {WINDOW_LIMIT_WHY}'
            )
        gpu_float64 = q.dtype == torch.float64 and not interpreted and self.max_gpu_float64_head_dim is not None
        limit = self.max_gpu_float64_head_dim if gpu_float64 else self.max_head_dim
        if limit is not None and q.shape[-1] > limit:
            in_float64 = ' in float64' if gpu_float64 else ''
            return f'the kernels take head dims up to {limit}{in_float64}, got {q.shape[-1]}: {HEAD_DIM_LIMIT_WHY}'
        return None


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """One attention op.

    Args:
        name (str): The op's name: its package ``visattn_mm.ops.<name>`` (with ``triton.py`` and ``reference.py``), its
            function ``<name>_attention``, its rows of the CUDA defaults table.
        softmax (bool): Whether it is a softmax attention ('fast' and 'math' are then two paths; an op
            without softmax, vicinity attention, has one torch path).
        trained_bias (bool): Whether its logits take a bias that trains (ViL's RPB): on the CPU, 'auto'
            keeps the explicit softmax for such a call in training (:func:`visattn_mm.ops.impl.chosen_path`).
        deciding_model (str): The backbone (its ``tools/analysis/benchmark.py`` name) whose training step
            decides the op's rows of the CUDA defaults table.
        triton_limits (TritonLimits): What its Triton kernels cannot run.
    """

    name: str
    softmax: bool
    trained_bias: bool
    deciding_model: str
    triton_limits: TritonLimits

    @property
    def torch_paths(self):
        """The fix a refused 'triton' call names: the torch paths that compute the op."""
        return "impl 'fast' or 'math'" if self.softmax else "impl 'math' (or 'fast')"


SLIDING_CHUNK = OpSpec('sliding_chunk', True, True, 'vil-s', TritonLimits(max_window=11))
LONG_SHORT = OpSpec('long_short', True, True, 'vil-ls-s', TritonLimits(max_window=11))
PALE = OpSpec('pale', True, False, 'pale-t', TritonLimits())
VICINITY = OpSpec('vicinity', False, False, 'vvt-s', TritonLimits(max_head_dim=64, max_gpu_float64_head_dim=32))

#: Every op, each with Triton kernels ('triton'), in the order the tables list them.
OP_SPECS = (SLIDING_CHUNK, LONG_SHORT, PALE, VICINITY)
OPS = {spec.name: spec for spec in OP_SPECS}
#: The ops' names, in that order.
OP_NAMES = tuple(OPS)


def op_spec(name):
    """The spec of the op ``name``.

    Raises:
        ValueError: For a name no spec has.
    """
    if name not in OPS:
        raise ValueError(f'unknown attention op {name!r}; the ops are {OP_NAMES} (visattn_mm.ops.specs)')
    return OPS[name]
