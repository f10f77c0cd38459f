"""Triton's interpreter without two of its costs that change no result, for the interpreted runs on the CPU
(the kernel tests' subprocesses, ``tools/analysis/triton_tuning.py --device cpu``): the kernels compute what
they compute uninterpreted, and each change is left out where the interpreter's layout differs (another
Triton). On the sliding-chunk kernel tests: the same results to the bit in 49 s instead of 131 s on one core.
"""

import dataclasses


def speed_up_the_interpreter():
    """Changes Triton's interpreter (3.x) for the rest of the process, once; returns the names of the changes
    made (where it was already changed, or its layout differs, fewer):

    - A ``@triton.jit`` helper called from a kernel patches ``triton.language`` only at its first call. The
      interpreter patches the language modules of the helper's globals (``_patch_lang``: ``inspect.getmembers``
      over four namespaces) at every call and never undoes it, so every later call found them patched already.
    - No int32 overflow check on every integer add, sub and mul (``sanitize_overflow``, on in the interpreter
      and off in compiled kernels unless debugging): it doubled the interpreted integer arithmetic. At the
      tests' sizes an index can only overflow through a wrong stride, whose address the tests' bounds check
      refuses (``tests/triton_harness.py``).
    """
    from triton.runtime import interpreter

    changes = []
    device_function = getattr(interpreter, 'InterpretedFunction', None)
    if (
        callable(getattr(device_function, 'rewrite', None))
        and hasattr(interpreter, 'InterpreterError')
        and not hasattr(device_function.__call__, 'first_calls_patched')
    ):
        first_call = device_function.__call__
        patched = set()

        def call(self, *args, **kwargs):
            if self.fn not in patched:
                patched.add(self.fn)
                return first_call(self, *args, **kwargs)
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as error:
                raise interpreter.InterpreterError(repr(error)) from error

        call.first_calls_patched = patched
        device_function.__call__ = call
        changes.append('helpers patch at their first call')
    builder = getattr(interpreter, 'interpreter_builder', None)
    options = getattr(builder, 'options', None)
    if dataclasses.is_dataclass(options) and getattr(options, 'sanitize_overflow', False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
        changes.append('no int32 overflow check')
    return changes
