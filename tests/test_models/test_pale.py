"""Pale Transformer backbone: fidelity (parameter counts, FLOPs, attention wiring), its BatchNorm size limit.

The backbone contract (outputs, out_indices, frozen_stages, norm_eval, with_cp, drop path,
init_cfg) is tested for every backbone in tests/test_models/test_backbone_contract.py.
"""

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import visattn_mm  # noqa: F401  (registration)
from helpers import PALE_TINY_ARCH as TINY_ARCH
from helpers import build_config_model_on_meta
from paths import ROOT
from visattn_mm.analysis.step_cost import trace_step
from visattn_mm.models import Classifier, PaleTransformer
from visattn_mm.models.pale import PaleAttention, separable_convs_as_one
from visattn_mm.ops.pale.reference import pale_attention_dense


def classifier_macs(arch, size=224):
    """Multiply-adds of the classifier at ``size x size``, counted on the meta device.

    ``torch.utils.flop_counter.FlopCounterMode`` counts convolutions and matrix
    products (2 FLOPs per multiply-add), nothing else -- the fvcore convention the
    paper's "FLOPs" (multiply-adds) follow: softmax, norms, GELU and additions are
    not counted. Returned in multiply-adds (FLOPs / 2).
    """
    with torch.device('meta'):
        model = Classifier(backbone_type='PaleTransformer', arch=arch).eval()
        x = torch.empty(1, 3, size, size)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops() / 2


@pytest.mark.parametrize('arch,paper_m,port_m', [('tiny', 22, 21.8), ('small', 48, 48.3), ('base', 85, 85.4)])
def test_classification_parameter_counts(arch, paper_m, port_m):
    """Pale paper, Table 2: 1000-class head on the pooled last stage.

    Within 2% of the paper, and equal after rounding to 0.1M to the unofficial port
    (the BatchNorm inside the q/k/v separable convs and the depthwise biases are
    what bring T and B up to 21.8M / 85.4M).
    """
    with torch.device('meta'):
        model = Classifier(backbone_type='PaleTransformer', arch=arch, num_classes=1000)
    count = sum(p.numel() for p in model.parameters()) / 1e6
    assert abs(count - paper_m) / paper_m < 0.02, count
    assert round(count, 1) == port_m, count


@pytest.mark.parametrize('arch,paper_g', [('tiny', 4.2), ('small', 9.0), ('base', 15.6)])
def test_classification_flops_at_224(arch, paper_g):
    """Measured: 4.20 / 8.98 / 15.53 G multiply-adds (paper: 4.2 / 9.0 / 15.6G)."""
    macs = classifier_macs(arch) / 1e9
    assert abs(macs - paper_g) / paper_g < 0.02, macs


def test_detection_and_segmentation_config_parameter_counts():
    """Paper Tables 3-4: Mask R-CNN Pale-T 41M, UperNet Pale-T 52M."""
    for name in ('maskrcnn_pale_t_1x.py', 'upernet_pale_t_160k_ade20k.py'):
        assert 'default_scope' not in (ROOT / 'configs' / name).read_text()
    cfg, detector, count = build_config_model_on_meta('maskrcnn_pale_t_1x.py')
    assert cfg.default_scope == 'mmdet'
    assert cfg.optim_wrapper.optimizer.weight_decay == 0.001 and cfg.model.backbone.drop_path_rate == 0.2
    assert isinstance(detector.backbone, PaleTransformer) and detector.backbone.embed_dims == (64, 128, 256, 512)
    assert abs(count - 41) / 41 < 0.02, count

    cfg, segmentor, count = build_config_model_on_meta('upernet_pale_t_160k_ade20k.py')
    assert cfg.model.backbone.drop_path_rate == 0.3 and cfg.model.auxiliary_head.in_channels == 256
    assert cfg.default_scope == 'mmseg'
    assert isinstance(segmentor.backbone, PaleTransformer)
    assert abs(count - 52) / 52 < 0.02, count


def _module_reference(attn, x, hw):
    """The layer written out: depthwise conv -> BN -> pointwise conv for q, k, v; first C/2
    channels (first half of the heads) row groups, the rest column groups; dense attention; proj."""
    b, n, c = x.shape
    heads, d = attn.num_heads, c // attn.num_heads
    img = x.transpose(1, 2).reshape(b, c, *hw)

    def sep(conv):
        y = torch.nn.functional.conv2d(img, conv.dw.weight, conv.dw.bias, padding=1, groups=c)
        y = conv.bn(y)
        return torch.einsum('oi,bihw->bohw', conv.pw.weight[:, :, 0, 0], y) + conv.pw.bias[:, None, None]

    q, k, v = (sep(conv).reshape(b, heads, d, n).transpose(-1, -2) for conv in (attn.q, attn.k, attn.v))
    out = pale_attention_dense(q * d**-0.5, k, v, *hw, attn.pale_size)
    return attn.proj(out.transpose(1, 2).reshape(b, n, c))


@pytest.mark.parametrize('hw,pale_size', [((9, 11), 7), ((3, 4), 7), ((8, 6), 3)])
def test_attention_layer_matches_dense_reference(hw, pale_size):
    torch.manual_seed(0)
    attn = PaleAttention(24, num_heads=4, pale_size=pale_size).double().eval()
    for bn in (attn.q.bn, attn.k.bn, attn.v.bn):  # non-trivial BatchNorm statistics
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    x = torch.randn(2, hw[0] * hw[1], 24, dtype=torch.float64)
    torch.testing.assert_close(attn(x, hw), _module_reference(attn, x, hw), rtol=1e-5, atol=1e-5)


def _attention_with_statistics(qkv_bias=True, momentum=0.1):
    """A float64 PaleAttention whose q/k/v BatchNorms have non-trivial statistics and affine values."""
    torch.manual_seed(0)
    attn = PaleAttention(24, num_heads=4, qkv_bias=qkv_bias).double()
    for conv in (attn.q, attn.k, attn.v):
        conv.bn.momentum = momentum
        conv.bn.running_mean.uniform_(-1, 1)
        conv.bn.running_var.uniform_(0.5, 2)
        conv.bn.weight.data.uniform_(0.5, 2)
        conv.bn.bias.data.uniform_(-1, 1)
    return attn


@pytest.mark.parametrize(
    'qkv_bias, momentum, training, used',
    [
        (True, 0.1, True, (0, 1, 2)),
        (False, 0.1, True, (0, 1, 2)),
        (True, None, True, (0, 1, 2)),  # cumulative average
        (True, 0.1, True, (0, 2)),  # k reaches no loss: no gradient arrives for it
        (True, 0.1, False, (0, 1, 2)),
    ],
)
@pytest.mark.parametrize('device', ['cpu', pytest.param('cuda', marks=pytest.mark.cuda)])
def test_qkv_projections_run_as_one_compute_what_each_computes(qkv_bias, momentum, training, used, device):
    """separable_convs_as_one against the three SeparableConv modules run one by one, float64: outputs,
    the input's and every parameter's gradient, BatchNorm's running statistics and counters (two steps)."""
    joined = _attention_with_statistics(qkv_bias, momentum).train(training).to(device)
    alone = copy.deepcopy(joined)
    hw, scales = (5, 7), (0.3, 1.0, 1.0)
    for step in range(2):
        x = torch.randn(2, 35, 24, dtype=torch.float64, device=device, requires_grad=True)
        x_alone = x.detach().clone().requires_grad_()
        outs = separable_convs_as_one(x, hw, (joined.q, joined.k, joined.v), scales)
        image = x_alone.transpose(1, 2).reshape(2, 24, *hw)
        convs = (alone.q, alone.k, alone.v)
        refs = [conv(image).flatten(2).transpose(1, 2) * scale for conv, scale in zip(convs, scales)]
        for out, ref in zip(outs, refs):
            torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        weights = [torch.randn_like(out) for out in outs]
        sum((outs[j] * weights[j]).sum() for j in used).backward()
        sum((refs[j] * weights[j]).sum() for j in used).backward()
        torch.testing.assert_close(x.grad, x_alone.grad, rtol=1e-12, atol=1e-12)
    for (name, param), (_, param_alone) in zip(joined.named_parameters(), alone.named_parameters()):
        if name.startswith(('q.', 'k.', 'v.')):
            # Joined, an unused projection's parameters get zero gradients; alone they get none.
            expected = torch.zeros_like(param) if param_alone.grad is None else param_alone.grad
            torch.testing.assert_close(param.grad, expected, rtol=1e-12, atol=1e-12, msg=name)
    for (name, buffer), (_, buffer_alone) in zip(joined.named_buffers(), alone.named_buffers()):
        torch.testing.assert_close(buffer, buffer_alone, rtol=1e-12, atol=1e-12, msg=name)
    assert int(joined.q.bn.num_batches_tracked) == (2 if training else 0)


def test_qkv_projections_launch_one_conv_and_one_norm_each_way():
    """One depthwise conv, one BatchNorm and three products forward; no layer runs once per projection."""
    attn = PaleAttention(32, num_heads=4).train()
    ops = trace_step(attn, (2, 48, 32), forward=lambda m, x: m(x, (6, 8))).ops
    assert ops['convolution'].launched == ops['convolution_backward'].launched == 1
    assert ops['native_batch_norm'].launched == ops['native_batch_norm_backward'].launched == 1
    assert ops['addmm'].launched == 3 + 1 + 6  # q/k/v and proj forward, the q/k/v backward


def test_qkv_projections_run_one_by_one_where_joined_would_differ():
    """SyncBatchNorm (mmengine's sync_bn) or BatchNorms in different modes: each projection runs alone."""
    attn = _attention_with_statistics().eval()
    x = torch.randn(2, 35, 24, dtype=torch.float64)
    expected = attn(x, (5, 7))
    synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(attn)).eval()
    mixed = copy.deepcopy(attn)
    mixed.k.bn.train()  # the others stay in eval; a training BatchNorm alone updates its statistics
    running_mean = mixed.k.bn.running_mean.clone()
    for model in (synced, mixed):
        with torch.no_grad():
            out = model(x, (5, 7))
        assert out.shape == expected.shape
    torch.testing.assert_close(synced(x, (5, 7)), expected, rtol=1e-12, atol=1e-12)
    assert not torch.equal(mixed.k.bn.running_mean, running_mean)
    assert torch.equal(mixed.q.bn.running_mean, attn.q.bn.running_mean)


def test_one_value_per_channel_trains_only_with_norm_eval():
    """A 32x32 image alone gives stage 4 a 1x1 map: training BatchNorm refuses it; with
    ``norm_eval=True`` it trains (tests/test_models/test_backbone_contract.py checks that and the frozen statistics)."""
    with pytest.raises(ValueError, match='more than 1 value'):
        PaleTransformer(arch=TINY_ARCH).train()(torch.randn(1, 3, 32, 32))
