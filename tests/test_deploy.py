"""Export out of PyTorch (visattn_mm.deploy): onnxruntime matches eager at two sizes through one file.

Each backbone family is exported with its first stage only (one block, tiny channels):
that stage holds the family's attention op with its size-dependent padding and masks,
which is what dynamic height and width must carry through; exporting all four stages
costs minutes of symbolic shape solving on CI's two cores (docs/deploy.md has the
commands for whole backbones and models).
"""
import pytest
import torch
from torch import nn

from helpers import build_tiny
from visattn_mm import deploy
from visattn_mm.models import PaleTransformer, ViL, ViLLS, VVT
from visattn_mm.ops.impl import attention_impl

pytest.importorskip('onnxruntime', reason='the deploy extra (pip install .[deploy]) is not installed')
pytest.importorskip('onnxscript', reason='the deploy extra (pip install .[deploy]) is not installed')

# Traced at one size, run at two others: batch 1 and 3, sides not multiples of the
# windows (padding and masks differ), every stage-1 map at least one Pale wide.
EXAMPLE = (2, 3, 96, 128)
CHECK_SIZES = ((1, 3, 60, 90), (3, 3, 112, 76))


def first_stage(cls):
    return build_tiny(cls, out_indices=(0, ), attn_impl='fast').eval()


@pytest.mark.parametrize('cls', [ViL, ViLLS, VVT, PaleTransformer], ids=lambda c: c.__name__)
def test_onnx_matches_eager_at_two_sizes(cls, tmp_path):
    model = first_stage(cls)
    shapes = deploy.image_dynamic_shapes(min_side=32, max_side=1024, max_batch=8)
    try:
        program = deploy.export_program(model, torch.randn(*EXAMPLE), shapes)
    except AssertionError as error:
        # torch 2.12's constraint solver fails while phrasing its suggested fixes, in some
        # runs only, for Pale and ViL-LS (open, docs/deploy.md); the parity checks below
        # stay strict whenever the export succeeds.
        if 'Cannot create Dim with inconsistent' in str(error):
            pytest.xfail(f'torch.export constraint solver: {error}')
        raise
    deploy.export_onnx(program, tmp_path / 'stage.onnx')
    session = deploy.onnx_session(tmp_path / 'stage.onnx')
    for size in CHECK_SIZES:
        images = torch.randn(*size)
        with torch.no_grad():
            expected = model(images)
        actual = deploy.run_onnx(session, images)
        assert actual[0].shape == expected[0].shape
        assert deploy.max_relative_error(actual, expected) < 1e-4, size
        # The .pt2 program serves the same sizes.
        assert deploy.max_relative_error(program.module()(images), expected) < 1e-5, size


def test_triton_is_refused_naming_fast():
    model = build_tiny(VVT, out_indices=(0, ), attn_impl='triton')
    with pytest.raises(ValueError, match="attn_impl='fast'"):
        deploy.export_program(model, torch.randn(*EXAMPLE))
    with attention_impl('triton'), pytest.raises(ValueError, match='process-wide'):
        deploy.export_program(first_stage(VVT), torch.randn(*EXAMPLE))


def test_max_relative_error_scales_by_largest_magnitude():
    expected = [torch.tensor([100.0, 0.001])]
    assert deploy.max_relative_error([torch.tensor([100.0, 0.002])], expected) == pytest.approx(1e-5)
    assert deploy.max_relative_error([torch.tensor([101.0, 0.001])], expected) == pytest.approx(1e-2)


class _TwoGroupHead(nn.Module):
    """Stands in for an mmdet model: tensor mode returns (cls_scores, bbox_preds) over two levels."""

    def forward(self, images, mode='loss'):
        assert mode == 'tensor'
        levels = (images[:, :1], images[:, :1, ::2, ::2])
        return [level * 2 for level in levels], [level + 1 for level in levels]


def test_tensor_mode_flattens_and_regroups():
    wrapped = deploy.TensorMode(_TwoGroupHead())
    images = torch.randn(1, 3, 8, 8)
    flat = wrapped(images)
    assert len(flat) == 4 and wrapped.output_groups == (2, 2)
    cls_scores, bbox_preds = wrapped.regroup(flat)
    assert torch.equal(cls_scores[1], images[:, :1, ::2, ::2] * 2)
    assert torch.equal(bbox_preds[0], images[:, :1] + 1)
