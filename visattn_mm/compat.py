"""Let ``torch.load(weights_only=True)`` read mmengine's own checkpoints.

Since torch 2.6, ``torch.load`` defaults to ``weights_only=True``. mmengine
0.10.7 calls ``torch.load`` without the flag, and the checkpoints its Runner
writes pickle more than tensors: the ``message_hub`` keeps
:class:`~mmengine.logging.HistoryBuffer` objects (numpy arrays inside) and
``runtime_info`` holds numpy scalars. Resuming, and ``load_from`` of such a
file, therefore fails with ``UnpicklingError: Weights only load failed``.

Rather than turning the check off, :func:`mmengine_checkpoint_globals` allows
exactly what those checkpoints reference, for the loads inside it: every
checkpoint the package reads (:func:`visattn_mm.checkpoint.read_checkpoint`,
which the tools' Runner uses for ``load_from``, evaluation and ``--resume``).
Importing the package leaves torch's allowlist as it was;
:func:`allow_mmengine_checkpoints` adds the same entries process-wide, for code
that calls ``torch.load`` on such files itself. The entries
(found by saving real mmdet/mmseg Runner checkpoints, iteration- and
epoch-based, SGD and AdamW with LR schedulers, and loading them until no
``Unsupported global`` remained):

* ``mmengine.logging.history_buffer.HistoryBuffer``;
* numpy: ``ndarray``, ``dtype``, ``_core.multiarray._reconstruct`` and
  ``_core.multiarray.scalar`` (also under their numpy 1.x ``numpy.core``
  names), plus the ``numpy.dtypes.*DType`` classes: an unpickled dtype is an
  instance of one of them and torch only BUILDs allowlisted types. Runner
  checkpoints were seen to need ``Float64DType`` and ``Int64DType``; the
  other numeric ones are included because hooks may log other numeric
  types. Object, string and void dtypes are left out;
* ``builtins.getattr``, **not** the real one: ``HistoryBuffer.__getstate__``
  stores its statistics methods, which pickle protocol 2 writes as
  ``getattr(HistoryBuffer, 'mean')``. The name is mapped to
  :func:`_history_buffer_getattr`, which only resolves those methods on
  ``HistoryBuffer`` and raises for anything else.

None of these can run arbitrary code. While they are allowed, other weights-only
loads that reference ``getattr`` hit the same restricted function.
"""

from __future__ import annotations

import contextlib
import pickle

import torch

_registered = False

# Numeric numpy dtype classes (numpy >= 1.25). Float64DType and Int64DType
# are what Runner checkpoints contain; the rest cover other logged numbers.
_NUMPY_DTYPE_CLASSES = (
    'BoolDType',
    'Int8DType',
    'UInt8DType',
    'Int16DType',
    'UInt16DType',
    'Int32DType',
    'UInt32DType',
    'Int64DType',
    'UInt64DType',
    'LongDType',
    'ULongDType',
    'LongLongDType',
    'ULongLongDType',
    'ByteDType',
    'UByteDType',
    'ShortDType',
    'UShortDType',
    'IntDType',
    'UIntDType',
    'Float16DType',
    'Float32DType',
    'Float64DType',
    'LongDoubleDType',
    'Complex64DType',
    'Complex128DType',
    'CLongDoubleDType',
)


def _history_buffer_getattr(obj, name: str):
    """``getattr`` limited to HistoryBuffer's statistics methods.

    Registered under the name ``builtins.getattr`` for weights-only loads.
    """
    from mmengine.logging.history_buffer import HistoryBuffer

    # The class-level registry is empty until a first HistoryBuffer exists,
    # hence the defaults spelled out.
    allowed = {'min', 'max', 'current', 'mean', *HistoryBuffer._statistics_methods}
    if (
        obj is HistoryBuffer
        and isinstance(name, str)
        and name in allowed
        and callable(getattr(HistoryBuffer, name, None))
    ):
        return getattr(HistoryBuffer, name)
    raise pickle.UnpicklingError(
        f'weights-only load: getattr({obj!r}, {name!r}) is not allowed; only '
        'HistoryBuffer statistics methods are (see visattn_mm.compat)'
    )


def mmengine_safe_globals() -> list:
    """Return the allowlist entries that mmengine Runner checkpoints need.

    Entries are callables or ``(callable, 'qualified.name')`` pairs, the two
    forms :func:`torch.serialization.add_safe_globals` accepts.
    """
    import numpy as np
    from mmengine.logging.history_buffer import HistoryBuffer

    try:  # numpy >= 2 moved numpy.core to numpy._core
        from numpy._core import multiarray
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray

    entries: list = [
        HistoryBuffer,
        np.ndarray,
        np.dtype,
        (multiarray._reconstruct, 'numpy._core.multiarray._reconstruct'),
        (multiarray.scalar, 'numpy._core.multiarray.scalar'),
        # Checkpoints written under numpy 1.x reference numpy.core.*.
        (multiarray._reconstruct, 'numpy.core.multiarray._reconstruct'),
        (multiarray.scalar, 'numpy.core.multiarray.scalar'),
        (_history_buffer_getattr, 'builtins.getattr'),
    ]
    dtypes = getattr(np, 'dtypes', None)  # numpy >= 1.25
    if dtypes is not None:
        entries += [getattr(dtypes, name) for name in _NUMPY_DTYPE_CLASSES if hasattr(dtypes, name)]
    return entries


@contextlib.contextmanager
def mmengine_checkpoint_globals():
    """Inside, weights-only ``torch.load`` reads mmengine Runner checkpoints (the entries of
    :func:`mmengine_safe_globals`); outside, torch's allowlist is what it was. A torch without
    ``safe_globals`` predates the weights-only default and needs nothing."""
    safe_globals = getattr(torch.serialization, 'safe_globals', None)
    if safe_globals is None:
        yield
        return
    with safe_globals(mmengine_safe_globals()):
        yield


def allow_mmengine_checkpoints() -> bool:
    """Allow weights-only ``torch.load`` of mmengine Runner checkpoints, process-wide (for code that
    calls ``torch.load`` on them itself; the package's own loads use :func:`mmengine_checkpoint_globals`).

    Safe to call any number of times; only the first call does work.

    Returns:
        True if the entries are registered (by this or an earlier call),
        False if this torch has no ``add_safe_globals`` (it then predates
        the weights-only default and needs nothing).
    """
    global _registered
    add_safe_globals = getattr(torch.serialization, 'add_safe_globals', None)
    if add_safe_globals is None:
        return False
    if not _registered:
        add_safe_globals(mmengine_safe_globals())
        _registered = True
    return True
