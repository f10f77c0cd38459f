"""Launch settings a GPU measured faster than the rule of :func:`visattn_mm.ops.triton.host.launch_settings`, one
row per Triton kernel, input dtype and head-dim tile; every other launch keeps the rule's
(:func:`~visattn_mm.ops.triton.host.tuned_settings`). A row changes its kernel's compiled code, so the CUDA
defaults table's rows of that op run 'fast' until a GPU has passed the CUDA tests with it and timed it again.

Generated, not edited: ``.venv/bin/python tools/analysis/triton_tuning.py --from-csv CSV --write`` keeps, from a
device call's triton_tuning.csv, each kernel's fastest candidate that beat the package's settings by
at least 5%; then ``.venv/bin/python tools/analysis/triton_resources.py --digests write``.
"""

# Where the rows were measured (device: CSV), then the rows: (kernel, input dtype, head-dim tile): settings.
TUNED_FROM = []
TUNED_LAUNCHES = {}
