"""What the Triton kernels of the attention ops (``impl='triton'``) share.

* :mod:`.kernel_parts`: the ``@triton.jit`` building blocks the kernels share
  (tiles of rows, the online-softmax step, the FlashAttention-2 backward of a tile,
  the keys every query sees).
* :mod:`.host`: the host side the ops share: registration as custom ops, launches,
  launch settings and tile sizes, dtypes, and the checks of what the kernels support.
* :mod:`.interpreter`: the interpreter without two costs that change no result, for the
  interpreted runs on the CPU.

Each op's kernels and wrapper live in its own package, ``visattn_mm.ops.<op>.triton``
(imported by the op's function when its path is 'triton',
:func:`~visattn_mm.ops.impl.chosen_path`); each imports this package before ``triton``.

The index arithmetic the kernels share with the torch paths and the references comes
from :mod:`visattn_mm.ops.indexing`; nothing here imports a torch op module.

The kernels run on CUDA tensors, and on CPU tensors (float64 included) under
Triton's interpreter (:func:`~visattn_mm.ops.impl.triton_interpreted`), which
``TRITON_INTERPRET=1`` in the environment turns on before this package is imported
(tests).
"""

# Every module of the package imports triton: fail here, once, naming the fix.
try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except ImportError as error:
    raise ImportError(
        f"attention impl 'triton' needs the triton package, which does not import here ({error}). "
        "Install the triton version that matches your PyTorch (`pip install triton`; Linux CUDA "
        "builds of PyTorch bring it), or choose impl 'fast' or 'math'."
    ) from error
