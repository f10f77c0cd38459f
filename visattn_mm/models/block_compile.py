"""torch.compile of a backbone block by block (the backbones' ``compile_blocks`` argument).

Each block gets its own compiled function (:func:`compiled_block_runner`): dynamo keeps its graphs,
guards, recompile count and size history per code object, so every block has a copy of one runner's
code under its own name. One block's shapes (another stage's channels) never make another block's
dimensions dynamic, and no block's variants (input sizes, random-shift neighbours, the switch to
evaluation) count against another's recompile limit. A block compiles its first input size with
static shapes and, at the next size, one graph with dynamic sizes that serves every later size
(dynamo's default, ``dynamic=None``). Dynamo traces every block; where two blocks' graphs are equal
(the blocks of a stage in evaluation, or in training without stochastic depth, whose rate is a
constant of the graph), Inductor's FX graph cache can serve the second from the first's code. The
patch embeddings, stage norms, output norms and everything after the backbone (necks, heads) stay
eager. Our Triton attention ops are torch custom ops with fake functions: Inductor calls them as
they are.

Where compilation cannot run (a Python dynamo does not support, no C++ compiler for Inductor on the
CPU, no Triton for Inductor on a GPU), the backbone says why in one warning line through mmengine's
logger and runs eager.
"""

import logging
import time
import types
import weakref

import torch
import torch.utils.checkpoint as cp
from mmengine.logging import print_log

#: Guard failures a block may have before dynamo runs it eager: its first size, one dynamic-size
#: graph, each of ViL's 9 neighbour sets (random shift, then all 8), training and evaluation,
#: with room to spare (dynamo's default, 8, is less than ViL's random-shift training needs).
BLOCK_RECOMPILE_LIMIT = 64


def check_compile_option(value, name):
    """``compile_blocks`` as the keyword arguments of ``torch.compile``, or None when off.

    Args:
        value (bool | dict): False (eager), True (``torch.compile``'s defaults: Inductor,
            ``dynamic=None``) or a dict of ``torch.compile`` keyword arguments (``backend``,
            ``mode``, ``dynamic``, ``options``, ...).
        name (str): The backbone's class name, for the error message.

    Raises:
        ValueError: For anything else, or a dict with ``fullgraph`` (a block's graph breaks, if
            any, are the ops' business) or a keyword ``torch.compile`` does not take.
    """
    if value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        allowed = ('backend', 'mode', 'dynamic', 'options', 'disable')
        unknown = sorted(set(value) - set(allowed))
        if not unknown:
            return dict(value)
        raise ValueError(
            f'{name}: compile_blocks got {unknown}: it takes torch.compile keyword arguments among {allowed}'
        )
    raise ValueError(
        f'{name}: compile_blocks={value!r}: use False, True or a dict of torch.compile keyword arguments, '
        "e.g. dict(mode='max-autotune')"
    )


def compile_blocker(device_type, options):
    """Why ``torch.compile`` with ``options`` cannot run on ``device_type`` here, or None if it can.

    Asks what Inductor asks first: whether dynamo supports this Python, and for Inductor (the
    default backend) a C++ compiler on the CPU or Triton on a GPU. Other backends are not probed.
    """
    try:
        torch._dynamo.eval_frame.check_if_dynamo_supported()
    except RuntimeError as error:
        return f'torch.compile does not run here ({error}); use a Python that torch {torch.__version__} supports'
    if options.get('backend', 'inductor') != 'inductor':
        return None
    if device_type == 'cpu':
        return missing_cpp_compiler()
    if device_type == 'cuda' and not torch.utils._triton.has_triton():
        return "Inductor needs Triton on the GPU and it is missing: pip install triton (or backend='aot_eager')"
    return None


def missing_cpp_compiler():
    """Why Inductor finds no C++ compiler for the CPU (its own search), or None if it finds one."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # Inductor raises its own error types (InvalidCxxCompiler, RuntimeError)
        return (
            f'Inductor finds no C++ compiler for the CPU ({type(error).__name__}: {error}); install g++ '
            "(or clang++, or MSVC on Windows), or pass compile_blocks=dict(backend='aot_eager')"
        )
    return None


def call_block(block, *inputs, with_cp=False):
    """``block(*inputs)``, recomputed in backward under ``with_cp`` when the tokens (``inputs[0]``) need
    gradients; the code every block's compiled runner is a copy of."""
    # Gradient checkpointing inside the compiled function: dynamo traces it as a region that the
    # backward recomputes, which Inductor supports (compiled code inside an eager checkpoint would
    # run its compiled forward twice and keep the compiled graph's own saved tensors).
    if with_cp and inputs[0].requires_grad:
        return cp.checkpoint(block, *inputs, use_reentrant=False)
    return block(*inputs)


def compiled_block_runner(name, options):
    """``torch.compile(**options)`` of a copy of ``block(*inputs, with_cp=...)`` named ``name``.

    The copy has its own code object, hence its own dynamo cache (see the module docstring).
    """
    code = call_block.__code__.replace(co_name=name, co_qualname=name)
    runner = types.FunctionType(code, call_block.__globals__, name, None, None)
    runner.__kwdefaults__ = dict(call_block.__kwdefaults__)
    return torch.compile(runner, **options)


class BlockCompiler:
    """The compiled runners of one backbone's blocks, the probe, and the compile-time log line.

    Args:
        owner (str): The backbone's class name (in messages).
        options (dict): ``torch.compile`` keyword arguments (:func:`check_compile_option`).
    """

    def __init__(self, owner, options):
        self.owner = owner
        self.options = options
        # block -> its compiled runner; weak, so that a deleted block (``truncate``) leaves no entry
        self.runners = weakref.WeakKeyDictionary()
        self.blockers = {}  # device type -> why compilation cannot run there, or None
        self.compiled_graphs = 0
        self.compile_seconds = 0.0

    def add(self, block, label):
        """Give ``block`` its compiled runner, named ``<owner>_<label>`` (compiled at its first call)."""
        self.runners[block] = compiled_block_runner(f'{self.owner}_{label}', self.options)

    def can_compile(self, device_type):
        """Whether compilation runs on ``device_type``; the first time it cannot, one warning line says why."""
        if device_type not in self.blockers:
            blocker = compile_blocker(device_type, self.options)
            self.blockers[device_type] = blocker
            if blocker is not None:
                print_log(
                    f'{self.owner}: compile_blocks is on, but {blocker}. Running eager.', 'current', logging.WARNING
                )
        return self.blockers[device_type] is None

    def run(self, block, *inputs, with_cp=False):
        """``block(*inputs)`` through its compiled runner (eager where compilation cannot run, and inside a
        torch.compile of the whole model, which traces the block itself), the time of calls that
        compiled added to the next :meth:`report`.

        Args:
            block (nn.Module): A block given to :meth:`add`.
            *inputs: Its inputs, the tokens (a tensor) first.
            with_cp (bool): Gradient checkpointing of the block (when the tokens require grad).
        """
        if torch.compiler.is_compiling() or not self.can_compile(inputs[0].device.type):
            return call_block(block, *inputs, with_cp=with_cp)
        frames_before = torch._dynamo.utils.counters['frames']['ok']
        start = time.perf_counter()
        with torch._dynamo.config.patch(recompile_limit=BLOCK_RECOMPILE_LIMIT):
            out = self.runners[block](block, *inputs, with_cp=with_cp)
        compiled = torch._dynamo.utils.counters['frames']['ok'] - frames_before
        if compiled:
            self.compiled_graphs += compiled
            self.compile_seconds += time.perf_counter() - start
        return out

    def report(self, size):
        """Log one line if blocks compiled since the last report (a forward pass at ``size``)."""
        if self.compiled_graphs:
            print_log(
                f'{self.owner}: torch.compile built {self.compiled_graphs} block graph(s) for input size '
                f'{tuple(size)} in {self.compile_seconds:.1f} s (the first calls of the compiled blocks: '
                'dynamo and the forward compilation; a backward compiles at its first call)',
                'current',
            )
            self.compiled_graphs, self.compile_seconds = 0, 0.0
