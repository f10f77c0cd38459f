"""Pure attention math: tensors in, tensors out, no module state."""

from .impl import ATTENTION_IMPLS, attention_impl, get_attention_impl, set_attention_impl

__all__ = ['ATTENTION_IMPLS', 'attention_impl', 'get_attention_impl', 'set_attention_impl']
