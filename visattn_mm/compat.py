"""Let ``torch.load(weights_only=True)`` read mmengine's own checkpoints.

Since torch 2.6, ``torch.load`` defaults to ``weights_only=True``. mmengine
0.10.7 calls ``torch.load`` without the flag, and the checkpoints its Runner
writes pickle more than tensors: the ``message_hub`` keeps
:class:`~mmengine.logging.HistoryBuffer` objects holding numpy arrays, and
``meta`` holds numpy scalars. Resuming (and ``load_from`` of such a file)
therefore fails with ``UnpicklingError: Weights only load failed``.

Rather than turning the safety check off, :func:`allow_mmengine_checkpoints`
adds exactly the classes and functions those checkpoints reference to torch's
weights-only allowlist. The list was found by saving real Runner checkpoints
(mmdet and mmseg, iteration- and epoch-based) and loading them with
``weights_only=True`` until no ``Unsupported global`` remained. None of the
entries can execute arbitrary code: they are numpy array/scalar/dtype
reconstructors and two plain-data mmengine containers.
"""
from __future__ import annotations

import torch

_registered = False

# Numeric numpy dtype classes (numpy >= 1.25 pickles dtypes through them).
# Object/void/string dtypes are deliberately left out.
_NUMPY_DTYPE_CLASSES = (
    'BoolDType', 'Int8DType', 'UInt8DType', 'Int16DType', 'UInt16DType',
    'Int32DType', 'UInt32DType', 'Int64DType', 'UInt64DType', 'LongDType',
    'ULongDType', 'LongLongDType', 'ULongLongDType', 'ByteDType', 'UByteDType',
    'ShortDType', 'UShortDType', 'IntDType', 'UIntDType', 'Float16DType',
    'Float32DType', 'Float64DType', 'LongDoubleDType', 'Complex64DType',
    'Complex128DType', 'CLongDoubleDType')


def mmengine_safe_globals() -> list:
    """Return the allowlist entries that mmengine Runner checkpoints need.

    Entries are callables or ``(callable, 'qualified.name')`` pairs, the two
    forms :func:`torch.serialization.add_safe_globals` accepts; the pairs
    cover names under which numpy 1.x wrote the same functions, so
    checkpoints from older environments load too.
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
        multiarray._reconstruct,
        multiarray.scalar,
        # Checkpoints written under numpy 1.x reference numpy.core.*.
        (multiarray._reconstruct, 'numpy.core.multiarray._reconstruct'),
        (multiarray.scalar, 'numpy.core.multiarray.scalar'),
    ]
    dtypes = getattr(np, 'dtypes', None)  # numpy >= 1.25
    if dtypes is not None:
        entries += [getattr(dtypes, name) for name in _NUMPY_DTYPE_CLASSES
                    if hasattr(dtypes, name)]
    return entries


def allow_mmengine_checkpoints() -> bool:
    """Allow weights-only ``torch.load`` of mmengine Runner checkpoints.

    Safe to call any number of times; only the first call does work.

    Returns:
        True if entries were added to torch's allowlist by this or an
        earlier call, False if this torch has no ``add_safe_globals`` (it
        then predates the weights-only default and needs nothing).
    """
    global _registered
    add_safe_globals = getattr(torch.serialization, 'add_safe_globals', None)
    if add_safe_globals is None:
        return False
    if not _registered:
        add_safe_globals(mmengine_safe_globals())
        _registered = True
    return True
