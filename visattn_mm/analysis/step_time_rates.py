"""Costs of the step-time estimate (:mod:`visattn_mm.analysis.step_time`) per GPU kind, ms per unit.

Written by ``tools/analysis/step_time_calibration.py --write``: rerun it rather than edit this file.
"""

FITTED_AT = 'b149109'  # the tree traced
FITTED_ON = {
    'H100': ('gpu_2026-11-26/call1',),
    'H200': ('gpu_2026-11-26/call3',),
}
FITTED_ROWS = {
    'H100': 20,
    'H200': 16,
}
COSTS = {
    'H100': {
        'attention:bytes': 12.63,
        'attention:flops_16bit': 0.0,
        'attention:flops_fp32': 29.02,
        'elementwise:bytes': 0.0,
        'fill:bytes': 0.0,
        'launches:aten': 0.03875,
        'launches:ours': 0.3298,
        'layout:bytes': 0.0,
        'matmul:bytes': 1.711,
        'matmul:flops_16bit': 9.131,
        'matmul:flops_fp32': 12.95,
        'norm:bytes': 0.0,
        'ours:triton_pale_attention:bytes': 18.57,
        'reduction:bytes': 0.0,
        'softmax:bytes': 0.8024,
    },
    'H200': {
        'attention:bytes': 9.755,
        'attention:flops_16bit': 0.0,
        'attention:flops_fp32': 32.39,
        'elementwise:bytes': 0.0,
        'fill:bytes': 0.0,
        'launches:aten': 0.0417,
        'launches:ours': 0.6525,
        'layout:bytes': 0.0,
        'matmul:bytes': 1.712,
        'matmul:flops_16bit': 5.901,
        'matmul:flops_fp32': 11.07,
        'norm:bytes': 0.0,
        'ours:triton_pale_attention:bytes': 19.67,
        'reduction:bytes': 0.0,
        'softmax:bytes': 0.0,
    },
}
