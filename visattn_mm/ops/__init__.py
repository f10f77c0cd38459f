"""Pure attention math: tensors in, tensors out, no module state."""
