"""The backbones' ``cuda_graphs`` option (visattn_mm/models/cuda_graphs.py): which calls replay the captured
graph and which run eager, saying so once; on a GPU, that training with it computes what eager training does."""

import copy

import pytest
import torch

from helpers import BACKBONES, build_tiny, logged_lines
from visattn_mm.models import ViL, cuda_graphs

SIZE = (32, 48)


@pytest.mark.parametrize(
    'kwargs,message',
    [
        (dict(cuda_graphs=1), 'cuda_graphs=1 must be True or False'),
        (dict(cuda_graphs=True, compile_blocks=True), 'cuda_graphs and compile_blocks cannot both be on'),
    ],
)
def test_refused_settings_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_tiny(ViL, **kwargs)


class StandInCapture:
    """Records the captures; the 'graph' runs the eager forward and counts its replays."""

    def __init__(self):
        self.captured, self.replays = [], 0

    def __call__(self, backbone, forward, x):
        self.captured.append(tuple(x.shape))

        def replay(batch):
            self.replays += 1
            return forward(batch)

        return replay


def test_the_first_training_size_replays_and_everything_else_runs_eager_saying_so_once(monkeypatch):
    stand_in = StandInCapture()
    monkeypatch.setattr(cuda_graphs, 'capture', stand_in)
    torch.manual_seed(0)
    model = build_tiny(ViL, cuda_graphs=True, drop_path_rate=0.0).train()
    model.graphs.device_type = 'cpu'
    eager = copy.deepcopy(model)
    assert eager.graphs.graphed is None and eager.graphs is not model.graphs  # a copy captures anew
    image, other = torch.randn(2, 3, *SIZE), torch.randn(2, 3, 40, 48)

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b))

    with logged_lines() as lines:
        assert same(model(image), eager.eager_forward(image)) and stand_in.captured == [(2, 3, *SIZE)]
        assert same(model(image), eager.eager_forward(image)) and stand_in.replays == 2
        for _ in range(2):  # another size: eager, one warning
            assert same(model(other), eager.eager_forward(other))
        with torch.no_grad():  # no gradient (evaluation's forward): eager, silently
            model(image)
        model.eval()
        model(image)
        model.train()
        with torch.autocast('cpu', dtype=torch.bfloat16):  # another autocast dtype is another input
            model(image)
    assert stand_in.captured == [(2, 3, *SIZE)] and stand_in.replays == 2
    assert len(lines) == 3 and 'ViL: captured the training forward and backward for input (2, 3, 32, 48)' in lines[0]
    assert lines[1:] == [
        'ViL: cuda_graphs keeps the graph of the first training input, (2, 3, 32, 48) (torch.float32, autocast '
        'None); (2, 3, 40, 48) (torch.float32, autocast None) runs eager',
        'ViL: cuda_graphs keeps the graph of the first training input, (2, 3, 32, 48) (torch.float32, autocast '
        'None); (2, 3, 32, 48) (torch.float32, autocast torch.bfloat16) runs eager',
    ]
    # Random shift draws on the host: eager while it is on, saying so once.
    model.stages[0].blocks[0].attn.random_shift = True
    with logged_lines() as lines:
        model(image)
        model(image)
    assert lines == [
        'ViL: cuda_graphs is on, but random shift draws a neighbour per block and step: those steps run eager'
    ]
    assert stand_in.replays == 2


@pytest.mark.cuda
@pytest.mark.parametrize('cls', BACKBONES, ids=lambda cls: cls.__name__)
def test_graphed_training_computes_what_eager_training_does(cls):
    """Three bf16 SGD steps on CUDA with ``cuda_graphs=True`` (captured at the first) and without: the same
    parameters and BatchNorm statistics afterwards, within bf16's rounding (the capture's warm-up steps
    add three momentum updates of the first batch's statistics to Pale's BatchNorms: the eager model takes
    them too)."""
    torch.manual_seed(0)
    graphed = build_tiny(cls, cuda_graphs=True, drop_path_rate=0.0).cuda().train()
    eager = copy.deepcopy(graphed)
    eager.graphs = None
    images = [torch.randn(2, 3, *SIZE, device='cuda') for _ in range(3)]
    for model in (graphed, eager):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step, image in enumerate(images):
            if model is eager and step == 0:
                with torch.no_grad():  # the capture's three warm-up steps, as BatchNorm sees them
                    for _ in range(3):
                        with torch.autocast('cuda', dtype=torch.bfloat16):
                            model(image)
            with torch.autocast('cuda', dtype=torch.bfloat16):
                loss = sum(out.float().square().mean() for out in model(image))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
    assert graphed.graphs.graphed is not None
    for (name, a), b in zip(graphed.state_dict().items(), eager.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=3e-2, atol=3e-3, msg=name)
