"""Vicinity attention (VVT) against its quadratic form; clamps; precision; linear memory."""

import pytest
import torch

from helpers import OpRecorder
from visattn_mm.ops import attention_impl
from visattn_mm.ops.indexing import vicinity_positions, vicinity_weights
from visattn_mm.ops.vicinity import SignedClamp, preserve_features, signed_clamp, vicinity_attention
from visattn_mm.ops.vicinity.reference import vicinity_attention_dense

SIZES = [(1, 1), (1, 6), (5, 1), (3, 5), (7, 4), (6, 6)]


def inputs(height, width, seed=0, heads=2, dim=3, batch=2, positive_v=True):
    """q, k: mostly positive (ReLU still zeroes some entries); v positive or of any sign."""
    g = torch.Generator().manual_seed(seed)
    n = height * width
    r = lambda: torch.randn(batch, heads, n, dim, generator=g, dtype=torch.float64)  # noqa: E731
    q, k = 0.5 * r() + 0.5, 0.5 * r() + 0.5
    v = r().abs() + 0.5 if positive_v else r()
    return q, k, v


def test_positions_follow_the_row_major_definition():
    a, b = vicinity_positions(3, 4, dtype=torch.float64)
    t = torch.arange(12, dtype=torch.float64)
    torch.testing.assert_close(a, torch.pi / 2 * torch.div(t, 4, rounding_mode='floor') / 3)
    torch.testing.assert_close(b, torch.pi / 2 * (t % 4) / 4)


@pytest.mark.parametrize('height,width', SIZES)
def test_linear_equals_quadratic_where_clamp_is_inactive(height, width):
    q, k, v = inputs(height, width)
    fast = vicinity_attention(q, k, v, height, width)
    # The clamps did not act on these inputs: the unclamped computation is identical.
    torch.testing.assert_close(fast, vicinity_attention(q, k, v, height, width, clamp=False), rtol=1e-12, atol=0)
    assert (q < 0).any() and (k < 0).any()  # the ReLU kernel matters
    torch.testing.assert_close(fast, vicinity_attention_dense(q, k, v, height, width), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('height,width', SIZES)
def test_linear_equals_quadratic_without_clamps_for_any_values(height, width):
    q, k, v = inputs(height, width, seed=1, positive_v=False)
    q, k = q - 0.5, k - 0.5
    torch.testing.assert_close(
        vicinity_attention(q, k, v, height, width, clamp=False),
        vicinity_attention_dense(q, k, v, height, width, clamp=False),
        rtol=1e-5,
        atol=1e-5,
    )


def test_linear_equals_quadratic_when_normaliser_and_output_clamps_act():
    """Large queries: 1/Z > 1e4 and |q' KV| > 1e4, so those clamps act in both forms; KV stays in range."""
    q, k, v = inputs(4, 5, seed=2)
    q = q * 1e3
    fast = vicinity_attention(q, k, v, 4, 5)
    assert not torch.allclose(fast, vicinity_attention(q, k, v, 4, 5, clamp=False))
    torch.testing.assert_close(fast, vicinity_attention_dense(q, k, v, 4, 5), rtol=1e-5, atol=1e-5)


def test_gradients_match_the_quadratic_form():
    q, k, v = (t.requires_grad_() for t in inputs(3, 4, seed=3))
    grads = []
    for fn in (vicinity_attention, vicinity_attention_dense):
        out = fn(q, k, v, 3, 4)
        grads.append(
            torch.autograd.grad(
                (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum(), (q, k, v)
            )
        )
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert torch.autograd.gradcheck(
        lambda *t: vicinity_attention(*t, 3, 4, clamp=False),
        tuple(x.detach()[:1, :1].requires_grad_() for x in (q, k, v)),
    )


def test_signed_clamp_on_crafted_values():
    t = torch.tensor(
        [0.0, -0.0, 1e-9, -1e-6, 1e-4, 0.5, -3.0, 1e4, 2e5, -1e9, float('inf')], dtype=torch.float64, requires_grad=True
    )
    out = signed_clamp(t)
    expected = torch.tensor([0.0, 0.0, 1e-4, -1e-4, 1e-4, 0.5, -3.0, 1e4, 1e4, -1e4, 1e4], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    # Gradient 1 strictly inside the range, 0 where the clamp acted and at exact zeros.
    torch.testing.assert_close(t.grad, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0], dtype=torch.float64))


@pytest.mark.parametrize(
    'qv,kv_,vv,expected,unclamped',
    [
        # One token (a = b = 0, so q' = [q, 0, q, 0]), one channel. KV = k v; Z = 1 / (2 q k + 1e-4).
        (1e3, 1e-3, 1e-3, 0.2 / 2.0001, 2e-3 / 2.0001),  # tiny KV (1e-6) pushed up to 1e-4
        (1e3, 1e-3, -1e-3, -0.2 / 2.0001, -2e-3 / 2.0001),  # ... keeping its sign
        (1e3, 1e3, 1e3, 1.0, 1e3),  # huge KV, q'KV and tiny Z pushed to 1e4 / 1e-4
        (1e3, 1e3, 1e-9, 1e-4, 2e-3 / (2e6 + 1e-4)),  # ... and the tiny product (2e-5) pushed to 1e-4
        (1e-3, 1e-3, 1e6, 1e4, 2 / (2e-6 + 1e-4)),  # huge product (q'KV = 2, Z ~ 9804) pushed to 1e4
        (-1.0, 1.0, 1.0, 0.0, 0.0),  # ReLU zeroes q: the output stays exactly 0
    ],
)
def test_clamps_on_crafted_single_token(qv, kv_, vv, expected, unclamped):
    q, k, v = (torch.full((1, 1, 1, 1), x, dtype=torch.float64) for x in (qv, kv_, vv))
    out = vicinity_attention(q, k, v, 1, 1)
    torch.testing.assert_close(out.item(), expected, rtol=1e-9, atol=0)
    torch.testing.assert_close(vicinity_attention(q, k, v, 1, 1, clamp=False).item(), unclamped, rtol=1e-9, atol=0)
    if expected == 0.0:
        assert out.item() == 0.0  # not pushed to +-1e-4


def test_token_count_must_match_the_map():
    q = torch.zeros(1, 1, 6, 2)
    with pytest.raises(ValueError, match='2x4'):
        vicinity_attention(q, q, q, 2, 4)


def test_half_precision_inputs_are_computed_in_fp32():
    """fp16 q/k/v (as a Linear under autocast returns them): KV (~4e5) and the normaliser would
    overflow fp16; the op must upcast and agree with the fp32 result."""
    g = torch.Generator().manual_seed(0)
    h, w = 48, 64
    q, k, v = (torch.rand(1, 2, h * w, 8, generator=g) * 4 for _ in range(3))
    reference = vicinity_attention(q, k, v, h, w)
    assert (reference.abs() > 1e-3).all()
    recorder = OpRecorder()
    with recorder, torch.autocast('cpu', dtype=torch.bfloat16):
        out = vicinity_attention(q.half(), k.half(), v.half(), h, w)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-3)
    # Every product, sum and division ran in fp32 (positions: fp64) although autocast (bf16) was on.
    reductions = [
        (name, dtypes)
        for name, dtypes, _ in recorder.calls
        if name in ('mm', 'bmm', 'matmul', 'sum', 'reciprocal', 'div')
    ]
    assert sum(name == 'bmm' for name, _ in reductions) >= 2
    assert all(d[0] in (torch.float32, torch.float64) for _, d in reductions), reductions


def _peak(fn, height, width, dim=4):
    q, k, v = (t.requires_grad_() for t in inputs(height, width, heads=2, dim=dim, batch=1))
    recorder = OpRecorder()
    with recorder:
        out = fn(q, k, v, height, width)
        out.sum().backward()
    return recorder.max_numel


def test_memory_is_linear_in_the_number_of_tokens():
    """Largest tensor created in forward + backward: O(N * 4d), never N x N.

    The recorder sees every ATen op output, including autograd's; the dense
    reference, run the same way, does create N x N tensors (the check can fail).
    """
    sizes = [(16, 16), (32, 32), (64, 64)]
    peaks = [_peak(vicinity_attention, h, w) for h, w in sizes]
    for (h, w), peak in zip(sizes, peaks):
        n = h * w
        assert peak <= 2 * 16 * n, (n, peak)  # heads x 4d = 32 values per token
    assert peaks[2] / peaks[0] == pytest.approx(16, rel=0.05)  # 16x the tokens -> 16x the memory
    assert _peak(vicinity_attention_dense, 16, 16) >= 256 * 256


def test_training_keeps_q_k_v_and_the_small_sums_and_recomputes_the_same_gradients():
    """Recompute mode saves the three inputs, the small sums (``[KV | sum k']`` (B, h, 4d, d+1),
    where KV's clamp acted, ``1 / den`` (B, h, N)) and where the output's clamp acted (a boolean
    per output element) alone; not the fp32 4d-wide features (B, h, N, 4d). It gives the stored
    mode's outputs bit for bit and its gradients to round-off (its backward is written by hand,
    autograd's is not)."""
    q, k, v = (t.requires_grad_() for t in inputs(8, 8, seed=4))
    weights = torch.linspace(-1, 1, q.numel(), dtype=q.dtype).reshape(q.shape)
    results = {}
    for recompute in (True, False):
        saved = []

        def pack(t):
            saved.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = vicinity_attention(q, k, v, 8, 8, recompute=recompute)
        results[recompute] = (out, torch.autograd.grad((out * weights).sum(), (q, k, v)), sum(saved))
    batch, heads, tokens, dim = q.shape
    input_bytes = 3 * q.numel() * q.element_size()
    sums_bytes = batch * heads * (4 * dim * (dim + 1) * 8 + 4 * dim * dim + tokens * 8 + tokens * dim)
    assert results[True][2] == input_bytes + sums_bytes
    assert results[False][2] > 4 * input_bytes
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=0)
    for a, b in zip(results[True][1], results[False][1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize('scale,acting', [(1.0, ()), (1e-3, ('kv',)), (30.0, ('z',))])
def test_hand_written_backward_passes_gradcheck_with_the_clamps(scale, acting):
    """float64 gradcheck of the default training path (its own backward) with the clamps on,
    where they act (their masks zero gradients) and where they do not."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 3, generator=g, dtype=torch.float64) * scale for _ in range(3))
    q, k = q.abs() + 0.1 * scale, k.abs() + 0.1 * scale  # away from the ReLU's kink
    kv = torch.einsum('bhnd,bhne->bhde', k, v)  # unweighted: the 4d-wide KV is its weighted form
    z_inverse = torch.einsum('bhnd,bhmd->bhn', q, k)
    assert (kv.abs() < 1e-4).any().item() if 'kv' in acting else True
    assert (z_inverse > 1e4).any().item() if 'z' in acting else True
    args = tuple(t.requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(lambda *t: vicinity_attention(*t, 2, 3), args)
    stored = torch.autograd.grad(vicinity_attention(*args, 2, 3, recompute=False).sum(), args)
    for a, b in zip(torch.autograd.grad(vicinity_attention(*args, 2, 3).sum(), args), stored):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_signed_clamp_function_keeps_a_mask_and_matches_the_formula():
    """SignedClamp: the formula's values bit for bit and its gradient (crafted values, both
    boundaries, zeros), keeping one boolean per element instead of four tensors."""
    t = torch.tensor(
        [0.0, -0.0, 1e-9, -1e-6, 1e-4, -1e-4, 0.5, -3.0, 1e4, -1e4, 2e5, -1e9, float('inf')], dtype=torch.float64
    )
    grads = []
    for fn in (signed_clamp, SignedClamp.apply):
        x = t.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s.dtype) or s, lambda s: s):
            out = fn(x)
        (out * torch.arange(1.0, 14.0, dtype=torch.float64)).sum().backward()
        grads.append((out.detach(), x.grad, saved))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=0, atol=0)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=0, atol=0)
    assert grads[1][2] == [torch.bool] and len(grads[0][2]) >= 3


def test_preserve_features_function_matches_the_formula():
    """The Feature Preserving Connection's autograd function: the formula's values bit for bit,
    float64 gradcheck of out and gate, and its gradients with clamps acting (tiny and huge
    values) equal the formula's."""
    g = torch.Generator().manual_seed(6)
    out = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    gate = torch.rand(2, 4, generator=g, dtype=torch.float64)
    out[0, 0, 0], out[0, 1, 1], out[1, 2, 3] = 1e-7, -3e4, 0.0
    args = (out.requires_grad_(), gate.requires_grad_())
    formula = lambda o, s: signed_clamp(o + o * s[:, None, :])  # noqa: E731
    weights = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    results = []
    for fn in (formula, preserve_features):
        y = fn(*args)
        results.append((y.detach(), torch.autograd.grad((y * weights).sum(), args)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-15)
    assert torch.autograd.gradcheck(
        preserve_features, (out.detach()[:, 3:].clone().requires_grad_(), gate.detach().clone().requires_grad_())
    )


def test_weights_are_the_cosines_and_sines_of_the_positions_built_once():
    weights = vicinity_weights(3, 4, dtype=torch.float64)
    a, b = vicinity_positions(3, 4, dtype=torch.float64)
    torch.testing.assert_close(weights, torch.stack([a.cos(), a.sin(), b.cos(), b.sin()], dim=-1), rtol=0, atol=0)
    assert vicinity_weights(3, 4, dtype=torch.float64) is weights  # cached, not rebuilt
    assert vicinity_weights(3, 4, dtype=torch.bfloat16).dtype == torch.bfloat16


def _bf16_forward_backward(q, k, v, height, width, impl='auto', bf16_products=False):
    """Output and input gradients (float64) of bf16 ``q, k, v``, and the dtypes of the matrix products."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    recorder = OpRecorder()
    with recorder:
        out = vicinity_attention(q, k, v, height, width, impl=impl, bf16_products=bf16_products)
        weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
        grads = torch.autograd.grad((out.double() * weights).sum(), (q, k, v))
    products = {dtypes[0] for name, dtypes, _ in recorder.calls if name in ('mm', 'bmm')}
    return [out.double()] + [g.double() for g in grads], products


def test_bf16_products_are_opt_in():
    """bf16 inputs: every product in fp32 by default, whatever the impl; ``bf16_products=True`` runs
    them all, forward and backward, on bf16 operands (tensor cores). Both against the float64 result
    of the same bf16-rounded inputs: bf16 products cost little in the output and up to 15x in the
    gradients (the gradient of q is a small difference of two products), the figures the module
    docstring gives."""
    g = torch.Generator().manual_seed(0)
    h, w = 24, 32
    q, k, v = (torch.randn(2, 2, h * w, 32, generator=g).bfloat16() for _ in range(3))
    exact, _ = _bf16_forward_backward(q.double(), k.double(), v.double(), h, w)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    errors = {}
    for impl, bf16_products in (('auto', False), ('math', False), ('fast', False), ('auto', True)):
        results, products = _bf16_forward_backward(q, k, v, h, w, impl, bf16_products)
        assert results[0].isfinite().all()
        assert products == ({torch.bfloat16} if bf16_products else {torch.float32}), (impl, products)
        errors[impl, bf16_products] = [rel(a, b) for a, b in zip(results, exact)]
    assert errors['auto', False] == errors['math', False] == errors['fast', False]
    assert max(errors['auto', False]) < 3e-3, errors  # the bf16 rounding of the result
    assert errors['auto', True][0] < 5e-3, errors  # output
    assert max(errors['auto', True][1:]) < 5e-2, errors  # gradients
    # The process-wide selection does not choose the precision.
    with attention_impl('fast'):
        assert _bf16_forward_backward(q, k, v, h, w)[1] == {torch.float32}
