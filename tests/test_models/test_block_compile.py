"""The backbones' ``compile_blocks``: each block compiled on its own (visattn_mm.models.block_compile).

Compiled blocks give the eager outputs and gradients (Inductor on the CPU, fp32 round-off), keep the
state_dict, compile at most twice over changing input sizes, work with gradient checkpointing and
random shift, and where compilation cannot run say so in one line and run eager. Inductor compiles
slowly on the CPU: only ``test_inductor_blocks_match_eager_long`` uses it (the long test of this file,
not timed yet on an idle machine); the others count graphs with dynamo's test backends.
"""

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from helpers import TINY_ARCHS, build_tiny, logged_lines
from visattn_mm.models import PaleTransformer, SlidingChunkAttention, ViL, ViLLS, VVT, block_compile

# Sides of at least 320 pixels: every stage's map spans two chunks or pales, so that no side is a
# size dynamo specialises on (see tests/test_ops/test_compile.py, whose sizes these are).
CHANGING_SIZES = ((320, 384), (352, 416), (448, 448))


def twin(cls, compile_blocks, **kwargs):
    """An eager ``cls`` (its tiny arch unless ``kwargs`` give one) and a copy of its weights with
    ``compile_blocks``; no stochastic depth."""
    torch.manual_seed(0)
    kwargs = dict(dict(arch=TINY_ARCHS[cls], drop_path_rate=0.0), **kwargs)
    eager = cls(**kwargs)
    compiled = cls(compile_blocks=compile_blocks, **kwargs)
    compiled.load_state_dict(eager.state_dict())
    return eager, compiled


def outputs_and_grads(model, image):
    """The output maps and every parameter's gradient of ``sum(mean(out^2))``."""
    outs = model(image)
    grads = torch.autograd.grad(sum(o.pow(2).mean() for o in outs), list(model.parameters()))
    return [o.detach() for o in outs], grads


def assert_same_numbers(eager, compiled, image, rtol=1e-4, atol=1e-5):
    for expected, actual in zip(*(outputs_and_grads(m, image) for m in (eager, compiled))):
        for a, b in zip(actual, expected):
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def test_inductor_blocks_match_eager_long():
    """Inductor (torch.compile's default) on each block of a two-stage ViL, training at 64x64 in fp32: the
    eager outputs and every gradient within fp32 round-off; the state_dict is the eager model's, key for
    key, and loads back; one log line gives the compile time. Long: Inductor compiles each block's C++
    kernels on the CPU (2 min on a 2-core machine, without its cache), so the later stages, which repeat
    the second's code at other sizes, and the other backbones' blocks are left to the test backends."""
    cls = ViL
    arch = dict(depths=(1, 1), embed_dims=(16, 32), num_heads=(1, 2), patch_sizes=(4, 2), num_global_tokens=(1, 1))
    two_stage = dict(arch=arch, out_indices=(0, 1))
    eager, compiled = twin(cls, True, **two_stage)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    image = torch.randn(2, 3, 64, 64)
    torch._dynamo.reset()
    with logged_lines() as lines:
        assert_same_numbers(eager.train(), compiled.train(), image)
    blocks = sum(len(stage.blocks) for stage in compiled.stages)
    assert [line for line in lines if 'torch.compile built' in line] == [
        next(line for line in lines if f'built {blocks} block graph(s) for input size (64, 64) in' in line)
    ]
    reloaded = cls(drop_path_rate=0.0, **two_stage)
    reloaded.load_state_dict(compiled.state_dict())
    for a, b in zip(reloaded.eval()(image), eager.eval()(image)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def graph_count(model, sizes, training):
    """How many block graphs ``model`` (built with a counting backend) compiles at each size in turn,
    checking the eager outputs at each."""
    torch._dynamo.reset()
    counter = model.block_compiler.options['backend']
    counts = []
    # mkldnn off: PyTorch picks its CPU convolution kernel by the input's size and dynamo guards on
    # the choice; a tiny model's maps cross that threshold, a detector's do not (test_compile.py).
    with torch.backends.mkldnn.flags(enabled=False), torch.set_grad_enabled(training):
        model.train(training)
        for size in sizes:
            before = counter.frame_count
            image = torch.randn(1, 3, *size)
            outs = model(image)
            if training:
                sum(o.sum() for o in outs).backward()
            counts.append(counter.frame_count - before)
    return counts


@pytest.mark.parametrize(
    'cls,training',
    ((ViLLS, True), (PaleTransformer, True), (VVT, False)),
    ids=('ViLLS-train', 'Pale-train', 'VVT-eval'),
)
def test_blocks_compile_at_most_twice_over_changing_sizes(cls, training):
    """Each block: its first size static, the second dynamic, nothing for the third. Dynamo alone (the
    ``eager`` backend; the backward runs through autograd): whether a block compiles again is decided by
    dynamo's guards, before AOTAutograd sees the graph (the whole-model twin of this test,
    tests/test_ops/test_compile.py, counts with AOTAutograd). ViL-LS runs ViL's attention in stages 3-4."""
    counter = CompileCounterWithBackend('eager')
    model = build_tiny(cls, drop_path_rate=0.0, compile_blocks=dict(backend=counter))
    blocks = sum(len(stage.blocks) for stage in model.stages)
    assert graph_count(model, CHANGING_SIZES, training) == [blocks, blocks, 0]


def test_random_shift_compiles_each_neighbour_once_and_runs_the_eager_draws(monkeypatch):
    """ViL's random-shift training draws one of 8 neighbours per block and pass: each block compiles once
    per neighbour it draws (the raised recompile limit lets every draw compile: none falls back to
    eager), later passes reuse them, and the outputs are the eager model's for the same draws."""
    draws = set()
    draw = SlidingChunkAttention.resolve_shift_mode

    def recorded_draw(layer):
        mode = draw(layer)
        draws.add((id(layer), mode))
        return mode

    monkeypatch.setattr(SlidingChunkAttention, 'resolve_shift_mode', recorded_draw)
    counter = CompileCounterWithBackend('eager')
    eager, compiled = twin(ViL, dict(backend=counter), random_shift=True)
    torch._dynamo.reset()
    image = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        for seed in range(8):
            outs = []
            for model in (eager.train(), compiled.train()):
                torch.manual_seed(seed)
                outs.append(model(image))
            for a, b in zip(*outs):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    compiled_layers = {id(block.attn) for stage in compiled.stages for block in stage.blocks}
    compiled_draws = {(layer, mode) for layer, mode in draws if layer in compiled_layers}
    assert len(compiled_draws) > 2 * len(compiled_layers)  # several neighbours per block
    assert counter.frame_count == len(compiled_draws)


def test_gradient_checkpointing_with_compiled_blocks():
    """``with_cp`` inside each compiled block (dynamo's checkpoint region, recomputed in backward): the
    eager model's outputs and gradients."""
    eager, compiled = twin(VVT, dict(backend=CompileCounterWithBackend('aot_eager')), with_cp=True)
    torch._dynamo.reset()
    assert_same_numbers(eager.train(), compiled.train(), torch.randn(2, 3, 64, 64))
    assert compiled.block_compiler.options['backend'].frame_count == sum(len(s.blocks) for s in compiled.stages)


def test_without_a_cpp_compiler_it_says_so_once_and_runs_eager(monkeypatch):
    missing = 'Inductor finds no C++ compiler for the CPU (test); install g++'
    monkeypatch.setattr(block_compile, 'missing_cpp_compiler', lambda: missing)
    eager, compiled = twin(ViL, True)
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters['frames']['ok']
    with logged_lines() as lines:
        for _ in range(2):
            assert_same_numbers(eager.train(), compiled.train(), torch.randn(1, 3, 64, 64), rtol=0, atol=0)
    assert lines == [f'ViL: compile_blocks is on, but {missing}. Running eager.']
    assert torch._dynamo.utils.counters['frames']['ok'] == frames


@pytest.mark.parametrize('value', ('yes', 1, dict(fullgraph=True)), ids=('str', 'int', 'fullgraph'))
def test_bad_compile_blocks_is_refused_with_the_choices(value):
    with pytest.raises(ValueError, match='compile_blocks.*(torch.compile keyword arguments|False, True or a dict)'):
        build_tiny(VVT, compile_blocks=value)


@pytest.mark.cuda
@pytest.mark.parametrize('cls', (ViL, ViLLS, VVT, PaleTransformer), ids=lambda c: c.__name__)
def test_inductor_blocks_on_the_triton_path_match_eager_on_cuda(cls):
    """On a GPU, Inductor compiles each block around our Triton ops (custom ops it calls as they are):
    the eager model's outputs and gradients on the same path, fp32, within reordered-sum round-off."""
    from triton_harness import skip_unless_compiled

    skip_unless_compiled()
    eager, compiled = twin(cls, True, attn_impl='triton')
    torch._dynamo.reset()
    image = torch.randn(2, 3, 96, 128, device='cuda')
    assert_same_numbers(eager.cuda().train(), compiled.cuda().train(), image, rtol=1e-3, atol=1e-4)
