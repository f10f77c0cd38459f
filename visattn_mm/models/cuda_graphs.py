"""A backbone's training forward and backward replayed as CUDA graphs (the backbones' ``cuda_graphs`` argument).

At the configs' two images per GPU every backbone is bound by the host launching its kernels: a step of
ours launches thousands. Captured once as a CUDA graph (``torch.cuda.make_graphed_callables``), the
backbone's forward and its backward each launch as one graph. That needs the same work at every step:

* one input size (shape, dtype, autocast dtype): UperNet's 512x512 crops. A graph is kept for the first
  size trained at; other sizes run eager, and the first of them says so in one warning line;
* nothing drawn on the host per step: ViL's random shift (a neighbour per block and step) runs eager
  while it is on, saying so once; stochastic depth draws on the GPU and replays fine;
* parameters that stay where they are (optimisers update them in place) and no hooks on the backbone.

Evaluation (no gradient) and other devices run eager. The capture runs three warm-up steps on the first
batch and then records it, so BatchNorm's running statistics (Pale) see that batch three times more;
it is logged with its time. A replay writes the outputs into the graph's own buffers, which the next
step overwrites: what reads them (necks, heads) reads them within the step.
"""

import time

import torch
import torch.nn as nn
from mmengine.logging import print_log

__all__ = ['GraphedForward', 'check_cuda_graphs_option']


def check_cuda_graphs_option(value, name, compile_blocks):
    """``cuda_graphs`` as a bool, refusing what cannot work with it.

    Raises:
        ValueError: For a value other than True or False, or with ``compile_blocks`` on (compiled blocks
            inside a captured graph are not supported here).
    """
    if not isinstance(value, bool):
        raise ValueError(f'{name}: cuda_graphs={value!r} must be True or False')
    if value and compile_blocks is not False:
        raise ValueError(f'{name}: cuda_graphs and compile_blocks cannot both be on; choose one')
    return value


class _EagerStep(nn.Module):
    """The backbone's eager forward as a module whose parameters are the backbone's (what
    ``make_graphed_callables`` captures and hands the gradients of)."""

    def __init__(self, backbone, forward):
        super().__init__()
        self.backbone = backbone
        self.eager_forward = forward

    def forward(self, x):
        return self.eager_forward(x)


def capture(backbone, forward, x):
    """``forward`` of ``backbone`` on batches like ``x``, as a graphed callable (three warm-up steps, then
    the capture), under the caller's autocast dtype without autocast's cast cache (capture needs that)."""
    dtype = torch.get_autocast_dtype('cuda')
    with torch.autocast('cuda', dtype=dtype, enabled=torch.is_autocast_enabled('cuda'), cache_enabled=False):
        return torch.cuda.make_graphed_callables(_EagerStep(backbone, forward), (x,), allow_unused_input=True)


class GraphedForward:
    """The graphs of one backbone: the first training input size's graph, replayed for every batch of that
    size (:func:`capture`); every other call eager.

    Args:
        owner (str): The backbone's class name, for the log lines.
        device_type (str): The device whose training steps are captured: 'cuda' (tests give 'cpu' with a
            stand-in :func:`capture`).
    """

    def __init__(self, owner, device_type='cuda'):
        self.owner, self.device_type = owner, device_type
        self.key, self.graphed, self.warned = None, None, set()

    def __deepcopy__(self, memo):
        # A copy of the backbone (mmengine's EMA model) has parameters of its own: it captures anew.
        return GraphedForward(self.owner, self.device_type)

    def run(self, backbone, x, forward):
        """``forward(x)``, replayed from the graph where ``x`` is a training batch of the captured size (the first
        one captures it), else eager."""
        if not (backbone.training and torch.is_grad_enabled() and x.device.type == self.device_type):
            return forward(x)
        blocker = backbone.static_step_blocker()
        if blocker:
            self._warn_once(blocker, f'{self.owner}: cuda_graphs is on, but {blocker}: those steps run eager')
            return forward(x)
        key = (tuple(x.shape), x.dtype, torch.is_autocast_enabled(x.device.type))
        key += (torch.get_autocast_dtype(x.device.type) if key[-1] else None,)
        if self.graphed is None:
            start = time.perf_counter()
            self.key, self.graphed = key, capture(backbone, forward, x)
            print_log(
                f'{self.owner}: captured the training forward and backward for input {key[0]} as CUDA graphs '
                f'in {time.perf_counter() - start:.1f} s (3 warm-up steps on this batch, then the capture)',
                'current',
            )
        if key != self.key:
            self._warn_once(
                key,
                f'{self.owner}: cuda_graphs keeps the graph of the first training input, {self.key[0]} '
                f'({self.key[1]}, autocast {self.key[3]}); {key[0]} ({key[1]}, autocast {key[3]}) runs eager',
            )
            return forward(x)
        return self.graphed(x)

    def _warn_once(self, reason, message):
        if reason not in self.warned:
            self.warned.add(reason)
            print_log(message, 'current', level=30)
