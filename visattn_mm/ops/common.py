"""Numerics shared by the attention ops."""
import torch


def softmax_fp32(logits, dim=-1):
    """Softmax computed in at least fp32, returned in the input dtype.

    Half-precision logits (fp16/bf16 autocast) overflow or lose the -inf masks'
    neighbours; fp64 stays fp64 so reference comparisons are exact.
    """
    if logits.dtype in (torch.float16, torch.bfloat16):
        return logits.softmax(dim=dim, dtype=torch.float32).to(logits.dtype)
    return logits.softmax(dim=dim)
