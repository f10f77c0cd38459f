"""A step's GPU time estimated from the counts of :mod:`visattn_mm.analysis.step_cost`.

The counts (bytes, FLOPs, launches per op) are exact; milliseconds are not, so this is an
**estimate** that ranks changes between device calls and never replaces a measurement.

The model, small on purpose (every coefficient is a rate one can read):

* ``gpu = sum over terms of amount x cost per unit``, the terms being
  the bytes each op group moves (``<group>:bytes``, ms per GB: one effective bandwidth per group)
  and the FLOPs of matrix products and SDPA kernels (``<group>:flops_<precision>``, ms per TFLOP:
  one effective rate per group and precision, as fp32 products run on other units than 16-bit ones);
* ``host = sum over launch groups of launches x cost per launch`` (ms per launch: the Python,
  autograd and driver work that enqueues a kernel; our custom ops, ``ours``, apart from ATen's);
* ``estimate = max(gpu, host)``: the host enqueues kernels while the GPU runs earlier ones, so
  the slower of the two sets the step's time (a batch-2 step is host-bound, a batch-8 one mostly not).

Op groups are the tracer's op classes (``matmul`` holds GEMMs and convolutions, ``attention``
SDPA's kernels, then ``norm``, ``softmax``, ``reduction``, ``layout`` copies, ``fill``,
``elementwise`` with casts), except that each of our custom ops (``visattn_mm::<op>`` and its
``_backward``) is a group of its own, ``ours:<op>``: each kernel pair has its own efficiency.

:func:`fit_costs` fits the costs to measured steps by non-negative least squares on relative
error (every row counts alike, whatever its time), alternating between the rows it finds
GPU-bound (which fit the GPU terms) and host-bound (which fit the launch costs).
``tools/analysis/step_time_calibration.py`` runs it on the device calls' rows and writes the
costs per GPU kind into :mod:`visattn_mm.analysis.step_time_rates`.
"""

from __future__ import annotations

import numpy as np

# Units of the terms: the costs are milliseconds per unit.
UNITS = {'bytes': 1e9, 'flops': 1e12, 'launches': 1}
FLOP_GROUPS = ('matmul', 'attention')
OURS_PREFIX = 'visattn_mm::'
HOST_TERM_PREFIX = 'launches:'


def _group(op_name, op_class):
    if op_name.startswith(OURS_PREFIX):
        return 'ours:' + op_name[len(OURS_PREFIX) :].removesuffix('_backward')
    return op_class


def step_terms(cost, dtype):
    """The amounts of one traced step that the model prices, in the units of :data:`UNITS`.

    Args:
        cost (StepCost): A step traced by :func:`visattn_mm.analysis.step_cost.trace_step`.
        dtype (str): The step's setting, 'fp32', 'bf16' or 'fp16': fp32 steps' FLOPs are priced
            apart from 16-bit (autocast) steps'.

    Returns:
        dict[str, float]: ``{term: amount}``, e.g. ``{'matmul:bytes': GB, 'matmul:flops_16bit': TFLOP,
        'launches:aten': launches, ...}``; zero amounts left out.
    """
    if dtype not in ('fp32', 'bf16', 'fp16'):
        raise ValueError(f"dtype {dtype!r}: 'fp32', 'bf16' or 'fp16'")
    precision = 'fp32' if dtype == 'fp32' else '16bit'
    terms = {}

    def add(term, amount, unit):
        if amount:
            terms[term] = terms.get(term, 0.0) + amount / UNITS[unit]

    for name, op in cost.ops.items():
        group = _group(name, op.op_class)
        add(f'{group}:bytes', op.bytes_moved, 'bytes')
        if group in FLOP_GROUPS:
            add(f'{group}:flops_{precision}', op.flops, 'flops')
        add(HOST_TERM_PREFIX + ('ours' if name.startswith(OURS_PREFIX) else 'aten'), op.launched, 'launches')
    return terms


def estimate_parts(terms, costs):
    """``(gpu_ms, host_ms)`` of a step's ``terms`` (:func:`step_terms`) at ``costs`` (ms per unit).

    A term without a cost raises: a group the fit never saw (a new custom op, FLOPs in a precision
    no measured row had) cannot be priced; calibrate with rows that have it.
    """
    missing = sorted(term for term in terms if term not in costs)
    if missing:
        raise KeyError(
            f'no fitted cost for {", ".join(missing)}: no calibration row had them; rerun '
            'tools/analysis/step_time_calibration.py with device rows that do'
        )
    gpu = sum(amount * costs[term] for term, amount in terms.items() if not term.startswith(HOST_TERM_PREFIX))
    host = sum(amount * costs[term] for term, amount in terms.items() if term.startswith(HOST_TERM_PREFIX))
    return gpu, host


def estimate_ms(terms, costs):
    """The estimated step time in ms: ``max(gpu, host)`` of :func:`estimate_parts`."""
    return max(estimate_parts(terms, costs))


def nonnegative_least_squares(matrix, target, tolerance=1e-12):
    """``x >= 0`` minimising ``|matrix @ x - target|`` (Lawson and Hanson's active-set method).

    Args:
        matrix (np.ndarray): ``(rows, unknowns)``.
        target (np.ndarray): ``(rows,)``.
        tolerance (float): Gradient below which a zero unknown stays at zero.

    Returns:
        np.ndarray: ``(unknowns,)``.
    """
    unknowns = matrix.shape[1]
    solution = np.zeros(unknowns)
    free = np.zeros(unknowns, dtype=bool)
    for _ in range(3 * unknowns + 10):
        gradient = matrix.T @ (target - matrix @ solution)
        candidates = np.where(~free & (gradient > tolerance))[0]
        if not len(candidates):
            break
        free[candidates[np.argmax(gradient[candidates])]] = True
        while True:
            trial = np.zeros(unknowns)
            trial[free] = np.linalg.lstsq(matrix[:, free], target, rcond=None)[0]
            if np.all(trial[free] > 0):
                solution = trial
                break
            # Step from the current solution towards the trial one until an unknown reaches zero.
            shrinking = free & (trial <= 0)
            step = np.min(solution[shrinking] / (solution[shrinking] - trial[shrinking]))
            solution = solution + step * (trial - solution)
            free &= solution > tolerance
            solution[~free] = 0.0
    return solution


def _solve(rows, measured, names):
    """Costs of ``names`` fitted to ``rows`` on relative error; 0 for a term no row has."""
    if not len(rows):
        return dict.fromkeys(names, 0.0)
    matrix = np.array([[terms.get(name, 0.0) for name in names] for terms in rows]) / measured[:, None]
    return dict(zip(names, map(float, nonnegative_least_squares(matrix, np.ones(len(rows))))))


def relative_errors(rows, measured_ms, costs):
    """``estimate / measured - 1`` per row."""
    return np.array([estimate_ms(terms, costs) for terms in rows]) / np.asarray(measured_ms, dtype=float) - 1


def fit_costs(rows, measured_ms, rounds=30):
    """Costs (ms per unit) of every term in ``rows`` fitted to the measured times.

    Starts from ``gpu + host`` fitted to every row, then alternates: rows whose host part is the
    larger fit the launch costs, the others the GPU costs, until no row changes side; the round
    with the smallest squared relative error is kept.

    Args:
        rows (list[dict[str, float]]): :func:`step_terms` of each measured step.
        measured_ms (list[float]): Each step's measured time.
        rounds (int): Most alternations.

    Returns:
        dict[str, float]: ``{term: ms per unit}``.
    """
    measured = np.asarray(measured_ms, dtype=float)
    if len(rows) != len(measured) or not len(rows):
        raise ValueError(f'{len(rows)} rows of terms and {len(measured)} measured times: give one time per row')
    if np.any(measured <= 0):
        raise ValueError('measured times must be positive')
    names = sorted({name for terms in rows for name in terms})
    host_names = [name for name in names if name.startswith(HOST_TERM_PREFIX)]
    gpu_names = [name for name in names if name not in host_names]
    costs = _solve(rows, measured, names)
    best, best_loss, sides = costs, np.inf, None
    for _ in range(rounds):
        parts = np.array([estimate_parts(terms, costs) for terms in rows])
        host_bound = parts[:, 1] > parts[:, 0]
        loss = float(np.sum(relative_errors(rows, measured, costs) ** 2))
        if loss < best_loss:
            best, best_loss = costs, loss
        if sides is not None and np.array_equal(sides, host_bound):
            break
        sides = host_bound
        gpu_rows = [terms for terms, host in zip(rows, host_bound) if not host]
        host_rows = [terms for terms, host in zip(rows, host_bound) if host]
        costs = {
            **_solve(gpu_rows, measured[~host_bound], gpu_names),
            **_solve(host_rows, measured[host_bound], host_names),
        }
    return best


def effective_rate(term, cost_ms):
    """A cost in words: GB/s, TFLOP/s or us per launch, for tables."""
    if cost_ms <= 0:
        return 'not priced (0)'
    kind = term.split(':')[-1] if not term.startswith(HOST_TERM_PREFIX) else 'launches'
    if kind == 'bytes':
        return f'{1e3 / cost_ms:.0f} GB/s'
    if kind.startswith('flops'):
        return f'{1e3 / cost_ms:.1f} TFLOP/s'
    return f'{cost_ms * 1e3:.1f} us/launch'
