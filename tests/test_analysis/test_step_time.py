"""The step-time estimate (visattn_mm.analysis.step_time): the fit recovers known costs, the held-out
rows stay out of the fit, the estimate grows with launches and bytes, and its tools."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import build_tiny
from tool_runs import _load_tool
from visattn_mm.analysis import step_time, step_time_rates
from visattn_mm.analysis.step_cost import trace_step
from visattn_mm.models import ViL

step_cost_tool = _load_tool('analysis/step_cost_report')
step_time_calibration = _load_tool('analysis/step_time_calibration')

# Known costs, ms per unit (GB, TFLOP, launch): the fit must find them again.
TRUE_COSTS = {
    'matmul:bytes': 0.5,
    'matmul:flops_16bit': 2.0,
    'elementwise:bytes': 0.4,
    'ours:sliding_chunk:bytes': 3.0,
    'launches:aten': 0.03,
    'launches:ours': 0.05,
}
GPU_TERMS = [term for term in TRUE_COSTS if not term.startswith('launches:')]


def synthetic_rows(count=40, seed=0):
    """Rows of random amounts, half GPU-bound and half host-bound (few bytes), timed by ``TRUE_COSTS``."""
    rng = np.random.default_rng(seed)
    rows = []
    for index in range(count):
        gpu_scale = 100.0 if index % 2 else 1.0
        terms = {term: gpu_scale * rng.uniform(0.5, 2.0) for term in GPU_TERMS}
        terms.update({'launches:aten': rng.uniform(500, 3000), 'launches:ours': rng.uniform(0, 300)})
        rows.append(terms)
    return rows, [step_time.estimate_ms(terms, TRUE_COSTS) for terms in rows]


def test_fit_recovers_known_costs_from_both_sides():
    rows, measured = synthetic_rows()
    sides = [np.argmax(step_time.estimate_parts(terms, TRUE_COSTS)) for terms in rows]
    assert 0 < sum(sides) < len(rows)  # both GPU-bound and host-bound rows
    costs = step_time.fit_costs(rows, measured)
    assert costs.keys() == TRUE_COSTS.keys()
    for term, cost in TRUE_COSTS.items():
        assert costs[term] == pytest.approx(cost, rel=1e-6), term
    assert np.abs(step_time.relative_errors(rows, measured, costs)).max() < 1e-9


def test_nonnegative_least_squares_holds_the_bound():
    # Unconstrained least squares gives x = (2, -1); with x >= 0 the best is (mean of the targets, 0).
    matrix = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 0.0]])
    target = matrix @ np.array([2.0, -1.0])
    solution = step_time.nonnegative_least_squares(matrix, target)
    assert solution[1] == 0.0 and solution[0] == pytest.approx(target.mean(), rel=1e-9)
    unconstrained = step_time.nonnegative_least_squares(matrix, matrix @ np.array([2.0, 1.0]))
    assert unconstrained == pytest.approx([2.0, 1.0])


def _measured_rows(seed, call, gpu='H100'):
    rows, measured = synthetic_rows(count=20, seed=seed)
    return [dict(gpu=gpu, call=call, terms=terms, measured_ms=time) for terms, time in zip(rows, measured)]


def test_held_out_rows_stay_out_of_the_fit():
    rows = _measured_rows(0, 'gpu_a/call1') + _measured_rows(1, 'gpu_a/call2')
    costs, fitted_on, rows = step_time_calibration.calibrate(rows, ['gpu_a/call2'])
    assert fitted_on == {'H100': ['gpu_a/call1']}
    assert [row['held_out'] for row in rows] == [False] * 20 + [True] * 20
    # Held-out rows measured ten times slower change nothing in the fit, only their own errors.
    skewed = [dict(row, measured_ms=row['measured_ms'] * (10 if row['held_out'] else 1)) for row in rows]
    skewed_costs, _, skewed = step_time_calibration.calibrate(skewed, ['gpu_a/call2'])
    assert skewed_costs == costs
    assert all(row['error'] == pytest.approx(0.1 - 1) for row in skewed if row['held_out'])
    assert all(abs(row['error']) < 1e-9 for row in skewed if not row['held_out'])
    # The same rows, none held out: the skewed call pulls the costs.
    assert step_time_calibration.calibrate(skewed, [])[0] != costs


def test_measured_rows_are_read_from_both_places(tmp_path):
    header = 'model,impl,mode,dtype,batch,height,width,time_ms,status\n'
    for folder, gpu, line in (
        ('docs/gpu_2026-01-01/call1', 'NVIDIA H100 80GB HBM3', 'swin-t,-,fwd+bwd,bf16,8,800,1333,90.9,ok\n'),
        ('results/gpu_2026-01-02/call1', 'NVIDIA H200', 'vil-s,triton,fwd+bwd,fp32,2,800,1333,137,ok\n'),
        ('results/gpu_2026-01-02/call2', 'no GPU named', 'vil-s,triton,fwd+bwd,fp32,2,800,1333,137,ok\n'),
    ):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / 'benchmark.csv').write_text(header + line + 'r50,-,fwd,bf16,2,800,1333,6,ok\n')
        (tmp_path / folder / 'session.log').write_text(f'GPU: {gpu}\n')
    rows = step_time_calibration.measured_rows(('swin-t', 'vil-s', 'r50'), root=str(tmp_path))
    assert [(row['gpu'], row['call'], row['model'], row['batch'], row['measured_ms']) for row in rows] == [
        ('H100', 'gpu_2026-01-01/call1', 'swin-t', 8, 90.9),
        ('H200', 'gpu_2026-01-02/call1', 'vil-s', 2, 137.0),
    ]


@pytest.fixture(scope='module')
def tiny_triton_terms():
    model = build_tiny(ViL, attn_impl='triton').train()
    return step_time.step_terms(trace_step(model, (1, 3, 64, 64), mode='fwd+bwd'), 'bf16')


def test_terms_price_our_ops_apart(tiny_triton_terms):
    ours = [term for term in tiny_triton_terms if term.startswith('ours:') and term.endswith(':bytes')]
    assert ours and all(tiny_triton_terms[term] > 0 for term in ours) and tiny_triton_terms['launches:ours'] > 0
    assert tiny_triton_terms['matmul:flops_16bit'] > 0 and 'matmul:flops_fp32' not in tiny_triton_terms
    with pytest.raises(ValueError, match='dtype'):
        step_time.step_terms(None, 'fp8')


def test_estimate_grows_with_launches_and_bytes(tiny_triton_terms):
    costs = dict.fromkeys(tiny_triton_terms, 1.0)
    gpu, host = step_time.estimate_parts(tiny_triton_terms, costs)
    costs.update({term: costs[term] * 2 * gpu / host for term in costs if term.startswith('launches:')})
    base = step_time.estimate_ms(tiny_triton_terms, costs)  # host-bound: twice the GPU part
    more_launches = dict(tiny_triton_terms, **{'launches:aten': tiny_triton_terms['launches:aten'] * 1.5})
    assert step_time.estimate_ms(more_launches, costs) > base
    more_bytes = dict(tiny_triton_terms, **{'elementwise:bytes': tiny_triton_terms['elementwise:bytes'] + 3 * gpu})
    assert step_time.estimate_ms(more_bytes, costs) > base
    fewer_bytes = dict(tiny_triton_terms, **{'elementwise:bytes': 0.0})
    assert step_time.estimate_ms(fewer_bytes, costs) == base  # host-bound: bytes below the host cost are free
    with pytest.raises(KeyError, match='no fitted cost for .*ours:'):
        step_time.estimate_ms(tiny_triton_terms, {'launches:aten': 1.0})


def test_step_cost_tool_adds_an_estimate_column(tmp_path, capsys):
    kind = sorted(step_time_rates.COSTS)[0]
    argv = ['--models', 'none', '--batch', '1', '--size', '64x96', '--out-dir', str(tmp_path)]
    rows = step_cost_tool.main(argv + ['--estimate', kind])
    assert [row['model'] for row in rows] == ['swin-t', 'r50'] and all(row['est_ms'] > 0 for row in rows)
    printed = capsys.readouterr().out
    assert f'est_ms: ESTIMATED {kind}' in printed and '| est_ms |' in printed
    assert 'est_ms' in (tmp_path / 'step_cost.csv').read_text().splitlines()[0]
    assert all(row['est_ms'] is None for row in step_cost_tool.main(argv))
    assert '| est_ms |' not in capsys.readouterr().out


def test_fitted_costs_are_rates():
    assert step_time_rates.COSTS and step_time_rates.FITTED_ON.keys() == step_time_rates.COSTS.keys()
    for kind, costs in step_time_rates.COSTS.items():
        assert all(cost >= 0 for cost in costs.values()), kind
        assert set(step_time_rates.FITTED_ON[kind]).isdisjoint(step_time_calibration.DEFAULT_HELD_OUT), kind
