"""Everything the package keeps per process, in one object: :data:`STATE`.

Tests and tools that change it put it back with :meth:`ProcessState.reset`, which returns it to
how ``import visattn_mm`` left it (the attention selection of ``VISATTN_ATTENTION_IMPL``, empty
caches, no launches counted, no warning given).
"""

import collections
import dataclasses
import warnings
from typing import Optional


@dataclasses.dataclass
class ProcessState:
    """The process-wide switches, counters and caches.

    Attributes:
        attention_impl (str): What ``'auto'`` resolves to (:func:`visattn_mm.ops.impl.set_attention_impl`).
        default_attention_impl (str): Its value at import (``VISATTN_ATTENTION_IMPL``), which
            :meth:`reset` restores.
        dispatch_device_type (str, optional): The device type the ops choose their path for instead of
            their tensors' (:func:`visattn_mm.ops.impl.dispatch_as`); None: their tensors'.
        kernel_launches (collections.Counter): Triton kernel launches per kernel name (tests prove
            with it which path ran).
        device_caches (list): Every cache of :func:`visattn_mm.ops.common.device_cache`.
        warnings_given (set): The keys of the warnings given once per process (:meth:`warn_once`), e.g.
            ``('triton_skip', op, reason)``: what the package has said already, whoever said it.
    """

    attention_impl: str = 'auto'
    default_attention_impl: str = 'auto'
    dispatch_device_type: Optional[str] = None
    kernel_launches: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    device_caches: list = dataclasses.field(default_factory=list)
    warnings_given: set = dataclasses.field(default_factory=set)

    def warn_once(self, key, message, stacklevel=3):
        """Warn ``message`` unless a warning of ``key`` was given already in this process.

        Args:
            key (Hashable): What the warning is about.
            message (str): The warning.
            stacklevel (int): As for :func:`warnings.warn`; the default points at the caller's caller.
        """
        if key not in self.warnings_given:
            self.warnings_given.add(key)
            warnings.warn(message, stacklevel=stacklevel)

    def clear_device_caches(self):
        """Drops every cached constant (frees their device memory)."""
        for cache in self.device_caches:
            cache.cache_clear()

    def reset(self):
        """Back to how import left the process: the import's attention selection, no device override,
        no launches counted, empty caches, no warning given."""
        self.attention_impl = self.default_attention_impl
        self.dispatch_device_type = None
        self.kernel_launches.clear()
        self.clear_device_caches()
        self.warnings_given.clear()


STATE = ProcessState()
