"""Every backbone traces into one torch.compile graph: no graph break in training mode."""
import pytest
import torch
import torch._dynamo

from visattn_mm.models import VVT, PaleTransformer, ViL, ViLLS


@pytest.mark.parametrize('backbone', [ViL, ViLLS, VVT, PaleTransformer], ids=lambda c: c.__name__)
def test_tiny_backbone_traces_without_graph_breaks(backbone):
    model = backbone(arch='tiny').train()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model)(torch.randn(1, 3, 64, 96))
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1
