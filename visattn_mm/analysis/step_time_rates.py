"""Costs of the step-time estimate (:mod:`visattn_mm.analysis.step_time`) per GPU kind, ms per unit.

Written by ``tools/analysis/step_time_calibration.py --write``: rerun it rather than edit this file.
"""

FITTED_AT = 'none'
FITTED_ON = {}
FITTED_ROWS = {}
COSTS = {}
