"""The backbones' shared layers: the MLPs' training functions keep one hidden-wide tensor."""

import pytest
import torch

from visattn_mm.models.base import preset_names, with_aliases
from visattn_mm.models.layers import GeluLinear, Mlp
from visattn_mm.models.vvt import ConvMlp, _DepthwiseConvGeluLinear

TOKENS, HIDDEN = 12, 16
MLPS = {
    'mlp': (lambda: Mlp(4, HIDDEN), (), lambda m, x: m.fc2(m.act(m.fc1(x)))),
    'conv_mlp': (
        lambda: ConvMlp(4, HIDDEN),
        ((3, 4),),
        lambda m, x: m.fc2(m.act(m.dwconv(m.fc1(x), (3, 4)))),
    ),
}


@pytest.mark.parametrize('kind', sorted(MLPS))
@pytest.mark.parametrize('channels_first_grad', [False, True])
def test_mlp_training_function_keeps_one_hidden_tensor(kind, channels_first_grad):
    """In training the MLP's GELU and fc2 (and ConvMlp's depthwise conv) run as one autograd
    function: the modules' outputs bit for bit (fp32), their gradients to round-off (also for a
    gradient laid out channel-first, as the blocks receive it from the NCHW outputs), and one
    hidden-wide tensor kept for backward (autograd keeps two, ConvMlp's three)."""
    build, extra, by_modules = MLPS[kind]
    torch.manual_seed(0)
    mlp = build()
    x = torch.randn(2, TOKENS, 4, requires_grad=True)
    hidden_saved = []

    def pack(t):
        hidden_saved.extend([t.numel()] if t.numel() == 2 * TOKENS * HIDDEN else [])
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = mlp(x, *extra)
    assert len(hidden_saved) == 1, hidden_saved
    expected = by_modules(mlp, x)
    assert torch.equal(out, expected)
    grad = torch.randn(2, 4, TOKENS).transpose(1, 2) if channels_first_grad else torch.randn_like(out)
    params = [x, *mlp.parameters()]
    for got, plain in zip(torch.autograd.grad(out, params, grad), torch.autograd.grad(expected, params, grad)):
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-6)
    mlp.drop.p = 0.5  # dropout between the GELU and fc2: the modules one by one
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden_saved.clear()
        mlp(x, *extra)
    assert len(hidden_saved) > 1


def test_mlp_training_functions_pass_gradcheck():
    double = lambda *shape: torch.randn(*shape, dtype=torch.float64, requires_grad=True)  # noqa: E731
    assert torch.autograd.gradcheck(GeluLinear.apply, (double(2, 5, 3), double(6, 3), double(6)))
    # A channel-first gradient, as the blocks receive it.
    x, w, b = double(2, 5, 3), double(6, 3), double(6)
    grad = torch.randn(2, 6, 5, dtype=torch.float64).transpose(1, 2)
    got = torch.autograd.grad(GeluLinear.apply(x, w, b), (x, w, b), grad)
    plain = torch.autograd.grad(torch.nn.functional.linear(torch.nn.functional.gelu(x), w, b), (x, w, b), grad)
    for a, e in zip(got, plain):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    conv_args = (double(2, 3, 4, 5), double(3, 1, 3, 3), double(3), double(6, 3), double(6))
    assert torch.autograd.gradcheck(_DepthwiseConvGeluLinear.apply, conv_args)


def test_arch_presets_get_their_first_letter_as_alias_and_refuse_a_clash():
    presets = dict(tiny=dict(depths=(1,)), small=dict(depths=(2,)))
    zoo = with_aliases(presets)
    assert zoo['t'] is presets['tiny'] and zoo['s'] is presets['small'] and preset_names(zoo) == ('tiny', 'small')
    with pytest.raises(ValueError, match='distinct first letters'):
        with_aliases(dict(small=dict(), slim=dict()))
