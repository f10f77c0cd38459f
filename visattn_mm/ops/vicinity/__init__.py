"""Vicinity attention (VVT): linear attention with a 2-D Manhattan locality weight.

For a token ``t`` of an ``H x W`` map (row-major) the positions are
``a = (pi/2) * (t // W) / H`` and ``b = (pi/2) * (t % W) / W``, recomputed for
the current map size. Queries and keys go through the ReLU kernel and are
re-weighted into ``4d`` features

    q' = [q cos a, q sin a, q cos b, q sin b]     (k' likewise),

so that ``q'_i . k'_j = (q_i . k_j) (cos(a_i - a_j) + cos(b_i - b_j))``. The
attention is then computed linearly in the number of tokens N:

    KV = k'^T v            (4d x d per head)
    Z  = 1 / (q' . sum_j k'_j + eps)
    out = (q' KV) * Z

Like the official code, a signed clamp ``sign(t) * clamp(|t|, 1e-4, 1e4)`` (exact
zeros stay zero) is applied after KV, after Z, after ``q' KV`` and after the
multiplication by Z; the attention layer adds it after ``out_proj`` and after the
feature-preserving gate (:func:`preserve_features`).

Precision (autocast is switched off inside; the input dtype and ``bf16_products`` decide):

* fp32 / fp64 inputs: everything in that dtype.
* fp16 and bf16 inputs: upcast to fp32 throughout (default). The sums over a
  detection-sized map (and their gradients under a loss scale) overflow fp16.
* bf16 inputs with ``bf16_products=True`` (opt-in): the three matrix products take bf16
  operands, so they can run on tensor cores. The GEMMs accumulate in fp32 and bf16
  has fp32's range; the sum of the key features, the normaliser, the clamps and the
  scaling by Z stay in fp32. The forward loses little (relative error 3e-3
  against 1.7e-3 for fp32 products of the same bf16 inputs, both rounded to bf16),
  but the gradient of ``q`` is a small difference of the numerator's and the
  normaliser's terms, each rounded to bf16: its relative error grows to about 3e-2
  (2e-3 with fp32 products; ``tests/test_ops/test_vicinity.py`` measures both).
  Not the default until a GPU benchmark shows what the speed is worth.

Nothing of size ``N x N`` is built: the largest intermediates are the
``(B, heads, N, 4d)`` features, and in training only ``q``, ``k``, ``v``, the small
sums and the output clamp's mask are kept for backward (the rest is recomputed there).
KV and the key features' sum come from one product (``k'^T [v | 1]``), the numerator and
the normaliser from another (``q' [KV | sum k']``): each feature tensor is read once.

``impl='triton'`` runs the same function, in at least fp32, as Triton kernels
on CUDA tensors (:mod:`visattn_mm.ops.vicinity.triton`): no
``(B, heads, N, 4d)`` tensor at all, and the sums over the tokens spread over
the whole GPU; on other devices it computes like 'auto'.
"""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..impl import attention_path
from ..indexing import CLAMP_MAX, CLAMP_MIN, EPS, vicinity_weights


def signed_clamp(t, min_mag=CLAMP_MIN, max_mag=CLAMP_MAX):
    """``sign(t) * clamp(|t|, min_mag, max_mag)``: magnitudes forced into a range.

    Exact zeros stay zero (their sign is 0); tiny non-zero values become
    ``+-min_mag`` and huge ones ``+-max_mag``. The gradient is 1 inside the range
    and 0 outside it, as with the official in-place version.
    """
    return t.sign() * t.abs().clamp(min_mag, max_mag)


class SignedClamp(torch.autograd.Function):
    """:func:`signed_clamp` whose backward keeps one boolean per element.

    Autograd through the formula keeps ``t``, ``|t|``, ``sign(t)`` and the clamped
    magnitudes (four tensors of ``t``'s size) and runs about ten ops in backward;
    this keeps where the clamp acted and masks the gradient with one op. Same
    values; same gradient (1 where ``min_mag <= |t| <= max_mag``, else 0, exact
    zeros included, as the formula's ``clamp`` backward gives).
    """

    @staticmethod
    def forward(ctx, t, min_mag=CLAMP_MIN, max_mag=CLAMP_MAX):
        magnitude = t.abs()
        clamped = magnitude.clamp(min_mag, max_mag)
        # Where the clamp changed |t| (NaNs included, as the formula's ge/le mask).
        ctx.save_for_backward(clamped != magnitude)
        return t.sign() * clamped

    @staticmethod
    def backward(ctx, grad):
        (acted,) = ctx.saved_tensors
        return grad.masked_fill(acted, 0), None, None


def lean_signed_clamp(t, clamp=True):
    """:func:`signed_clamp` where ``clamp`` is set (else ``t``): :class:`SignedClamp` when a
    gradient will flow through it (one boolean kept per element), else the formula (no mask)."""
    if not clamp:
        return t
    return SignedClamp.apply(t) if torch.is_grad_enabled() and t.requires_grad else signed_clamp(t)


def vicinity_features(x, weights):
    """Re-weight kernel features ``x`` (``(..., N, d)``) into ``(..., N, 4d)``.

    ``weights`` is :func:`~visattn_mm.ops.indexing.vicinity_weights`' ``(N, 4)``. Order of the
    four blocks (as in the official code): ``x cos a``, ``x sin a``, ``x cos b``, ``x sin b``.
    """
    return (x[..., None, :] * weights[:, :, None]).flatten(-2)


def vicinity_attention(q, k, v, height, width, eps=EPS, clamp=True, recompute=True, impl='auto', bf16_products=False):
    """Linear vicinity attention of one map.

    Args:
        q (Tensor): ``(B, heads, N, d)`` query projections, before the ReLU kernel.
        k (Tensor): ``(B, heads, N, d)`` key projections, before the ReLU kernel.
        v (Tensor): ``(B, heads, N, d)`` values.
        height (int): Map height ``H``.
        width (int): Map width ``W``; ``N`` must equal ``H * W`` (row-major tokens).
        eps (float): Added to the normaliser's denominator. Default: 1e-4.
        clamp (bool): Apply the official signed clamps (after KV, Z, ``q' KV`` and
            the multiplication by Z). Default: True.
        recompute (bool): When a gradient is needed, keep only ``q``, ``k``, ``v``, the
            small sums and the output clamp's mask for backward and recompute the ``4d``-wide
            features there, instead
            of storing about a dozen ``(B, heads, N, 4d)`` intermediates
            (same numbers; one more cheap elementwise forward in backward).
            The Triton path always keeps only those and the small sums. Default: True.
        impl (str): The path: 'auto', 'fast', 'math' or 'triton' (what each runs:
            :mod:`visattn_mm.ops.impl`). Default: 'auto'.
        bf16_products (bool): Give bf16 inputs bf16 matrix products, on the torch path
            and the Triton kernels alike (tensor cores, coarser gradients; see the module
            docstring). False: at least fp32. Default: False.

    Returns:
        Tensor: ``(B, heads, N, d)`` in the dtype of ``q``.
    """
    n = q.shape[-2]
    if n != height * width:
        raise ValueError(f'vicinity_attention: {n} tokens do not form a {height}x{width} map')
    if attention_path('vicinity', q, impl=impl) == 'triton':
        from .triton import triton_vicinity_attention

        return triton_vicinity_attention(q, k, v, height, width, eps=eps, clamp=clamp, bf16_products=bf16_products)
    operands = matmul_dtype(q.dtype, bf16_products)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if recompute and needs_grad and operands == torch.promote_types(q.dtype, torch.float32):
        return _VicinityAttention.apply(q, k, v, height, width, eps, clamp)
    if recompute and needs_grad:
        return checkpoint(_vicinity_attention, q, k, v, height, width, eps, clamp, operands, use_reentrant=False)
    return _vicinity_attention(q, k, v, height, width, eps, clamp, operands)


def matmul_dtype(dtype, bf16_products=False):
    """Operand dtype of vicinity attention's torch-path matrix products for inputs of ``dtype``
    (see the module docstring): bf16 for bf16 inputs with ``bf16_products``, else at least fp32."""
    if dtype == torch.bfloat16 and bf16_products:
        return torch.bfloat16
    return torch.promote_types(dtype, torch.float32)


def _clamp_keeping_mask(t, clamp):
    """``(signed_clamp(t), where it acted)``: the clamp's values and the mask its backward needs
    (``None`` without ``clamp``)."""
    if not clamp:
        return t, None
    magnitude = t.abs()
    clamped = magnitude.clamp(CLAMP_MIN, CLAMP_MAX)
    return t.sign() * clamped, clamped != magnitude


def _with_ones_column(x, dtype):
    """``[x | 1]`` in ``dtype``: one more column of ones, so that a product with it also gives the
    column sums of the other factor (one pass over that factor instead of two)."""
    ones = torch.ones((), dtype=dtype, device=x.device).expand(*x.shape[:-1], 1)
    if torch.promote_types(x.dtype, dtype) != dtype:
        x = x.to(dtype)
    return torch.cat([x, ones], dim=-1)  # casts x on the way where it promotes: one pass


def _weighted_blocks_sum(features, weights):
    """``sum_j weights[:, j] * block_j`` of ``(..., N, 4d)`` features (the four ``d``-wide blocks of
    :func:`vicinity_features`): the gradient through the re-weighting, as one batched product that
    reads the features once."""
    blocks = features.unflatten(-1, (4, -1))  # (..., N, 4, d)
    return (weights[:, None, :] @ blocks).squeeze(-2)


def _vicinity_parts(q, k, v, height, width, eps, clamp, operands, keep=False):
    """The forward of :func:`vicinity_attention` (autocast off), returning ``(out, saved)``.

    ``saved`` is ``None``, or with ``keep`` what :class:`_VicinityAttention`'s backward keeps
    besides ``q``, ``k``, ``v``: ``[KV | sum of k']`` ``(B, h, 4d, d + 1)``, where the clamp acted
    on KV, ``1 / den`` ``(B, h, N)`` and where the output's clamp acted (one boolean per output
    element); none is as large as the inputs.

    Each product carries one more column: ``k'^T [v | 1]`` gives KV and the key features' sum,
    ``q' [KV | sum k']`` the numerator and the normaliser, so each 4d-wide feature tensor is read
    once. The ReLU runs on the inputs' dtype and the products with the (``operands``-dtype)
    weights promote: the same values as casting first, one op fewer per input.
    """
    compute = torch.promote_types(q.dtype, torch.float32)
    weights = vicinity_weights(height, width, q.device, operands)
    kf = vicinity_features(F.relu(k), weights)  # (B, h, N, 4d)
    kv_and_sum = (kf.transpose(-1, -2) @ _with_ones_column(v, operands)).to(compute)  # (B, h, 4d, d + 1)
    if keep:
        kv, kv_acted = _clamp_keeping_mask(kv_and_sum[..., :-1], clamp)
    else:
        kv, kv_acted = lean_signed_clamp(kv_and_sum[..., :-1], clamp), None
    kv_ext = torch.cat([kv, kv_and_sum[..., -1:]], dim=-1)
    qf = vicinity_features(F.relu(q), weights)
    numerator_and_den = (qf @ kv_ext.to(operands)).to(compute)  # (B, h, N, d + 1)
    reciprocal = 1.0 / (numerator_and_den[..., -1] + eps)  # (B, h, N)
    z = lean_signed_clamp(reciprocal, clamp)
    numerator = lean_signed_clamp(numerator_and_den[..., :-1], clamp)
    if not keep:
        return lean_signed_clamp(numerator * z[..., None], clamp).to(q.dtype), None
    out, out_acted = _clamp_keeping_mask(numerator * z[..., None], clamp)
    return out.to(q.dtype), (kv_ext, kv_acted, reciprocal, out_acted)


def _vicinity_attention(q, k, v, height, width, eps, clamp, operands):
    with torch.autocast(device_type=q.device.type, enabled=False):
        return _vicinity_parts(q, k, v, height, width, eps, clamp, operands)[0]


def _masked(grad, acted):
    return grad if acted is None else grad.masked_fill(acted, 0)


def _vicinity_grads(grad, q, k, v, saved, height, width, clamp, operands):
    """The gradients of ``q``, ``k``, ``v`` (in ``compute`` dtype) from the output's, given what
    :func:`_vicinity_parts` kept (``keep=True``).

    The 4d-wide features are recomputed (``q'``, ``k'``) and the numerator with its clamp masks
    (one product, as in forward). The products carry the normaliser's terms as one more column,
    as the forward's do: ``q'^T [g_num | g_den]`` gives the gradients of KV and of the key features'
    sum, ``[g_num | g_den] [KV | sum k']^T`` that of ``q'``, ``[v | 1] [g_KV | g_sum]^T`` that of
    ``k'``.
    """
    kv_ext, kv_acted, reciprocal, out_acted = saved
    compute = kv_ext.dtype
    weights = vicinity_weights(height, width, q.device, operands)
    qf = vicinity_features(F.relu(q), weights)
    numerator, numerator_acted = _clamp_keeping_mask((qf @ kv_ext.to(operands)).to(compute)[..., :-1], clamp)
    z, z_acted = _clamp_keeping_mask(reciprocal, clamp)
    grad = _masked(grad, out_acted)  # through out = numerator * z
    grad_z = _masked((grad * numerator).sum(dim=-1), z_acted)
    # z = 1 / den: d den = -d z / den^2 (z unclamped).
    grad_den = -grad_z * reciprocal * reciprocal
    grad_ext = torch.cat([_masked(grad * z[..., None], numerator_acted), grad_den[..., None]], dim=-1)
    grad_kv_and_sum = (qf.transpose(-1, -2) @ grad_ext.to(operands)).to(compute)  # (B, h, 4d, d + 1)
    grad_kv = _masked(grad_kv_and_sum[..., :-1], kv_acted)
    grad_qf = grad_ext.to(operands) @ kv_ext.transpose(-1, -2).to(operands)  # (B, h, N, 4d)
    grad_kv_ext = torch.cat([grad_kv, grad_kv_and_sum[..., -1:]], dim=-1).to(operands)
    grad_kf = _with_ones_column(v, operands) @ grad_kv_ext.transpose(-1, -2)
    grad_v = vicinity_features(F.relu(k), weights) @ grad_kv.to(operands)
    # Through x' = relu(x) w: the four weighted blocks summed, then the ReLU's mask.
    grad_q, grad_k = (
        torch.ops.aten.threshold_backward(_weighted_blocks_sum(g, weights).to(compute), x, 0)
        for g, x in ((grad_qf, q), (grad_kf, k))
    )
    return grad_q, grad_k, grad_v.to(compute)


class _VicinityAttention(torch.autograd.Function):
    """Vicinity attention computed in ``q``'s dtype promoted to at least fp32 ('auto', 'math'),
    keeping ``q``, ``k``, ``v``, the small sums (``[KV | sum k']``, ``1 / den``) and the output clamp's
    mask for backward.

    Backward recomputes the 4d-wide features and the numerator and applies the chain rule by
    hand (:func:`_vicinity_grads`): about a third of the ops of autograd through a recomputed
    forward (its clamps alone run ten ops each), none of the 4d-wide tensors kept between
    forward and backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, height, width, eps, clamp):
        operands = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(device_type=q.device.type, enabled=False):
            out, saved = _vicinity_parts(q, k, v, height, width, eps, clamp, operands, keep=True)
        ctx.save_for_backward(q, k, v, *saved)
        ctx.map_args = (height, width, clamp)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, *saved = ctx.saved_tensors
        height, width, clamp = ctx.map_args
        operands = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(device_type=q.device.type, enabled=False):
            grads = _vicinity_grads(grad, q, k, v, saved, height, width, clamp, operands)
        return *(g.to(x.dtype) for g, x in zip(grads, (q, k, v))), None, None, None, None


class _PreservedFeatures(torch.autograd.Function):
    """``signed_clamp(out + out * gate)`` keeping ``out``, ``gate`` and one boolean per element.

    Autograd through the formula also keeps the sum, its magnitude, sign and clamped
    magnitude (four more ``(B, N, C)`` tensors) and runs about fifteen ops in backward;
    this one runs five.
    """

    @staticmethod
    def forward(ctx, out, gate):
        gate = gate[:, None, :]
        preserved = out + out * gate
        magnitude = preserved.abs()
        clamped = magnitude.clamp(CLAMP_MIN, CLAMP_MAX)
        ctx.save_for_backward(out, gate, clamped != magnitude)
        return preserved.sign() * clamped

    @staticmethod
    def backward(ctx, grad):
        out, gate, acted = ctx.saved_tensors
        grad = grad.masked_fill(acted, 0)
        grad_out = grad_gate = None
        if ctx.needs_input_grad[0]:
            grad_out = torch.addcmul(grad, grad, gate)
        if ctx.needs_input_grad[1]:
            grad_gate = (grad * out).sum(dim=1, dtype=gate.dtype)
        return grad_out, grad_gate


def preserve_features(out, gate, clamp=True):
    """Feature Preserving Connection: ``out + out * gate``, then the signed clamp.

    When a gradient flows and ``clamp`` is set, one autograd function
    (:class:`_PreservedFeatures`) keeps only ``out``, ``gate`` and where the clamp acted.

    Args:
        out (Tensor): ``(B, N, C)`` attention output after ``out_proj`` (and its clamp).
        gate (Tensor): ``(B, C)`` sigmoid gate computed from the token mean.
        clamp (bool): Apply the signed clamp to the result. Default: True.
    """
    if clamp and torch.is_grad_enabled() and (out.requires_grad or gate.requires_grad):
        return _PreservedFeatures.apply(out, gate)
    return lean_signed_clamp(out + out * gate[:, None, :], clamp)
