"""Small building blocks shared by the backbone skeletons."""
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import trunc_normal_


class Mlp(nn.Module):
    """fc1 -> GELU -> dropout -> fc2 -> dropout (official key names ``fc1``/``fc2``)."""

    def __init__(self, dim, hidden_dim, drop=0.0):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


def pad_to_multiple(x, multiple):
    """Zero-pad an NCHW map at the bottom/right so both sides divide ``multiple``."""
    h, w = x.shape[-2:]
    pad_h, pad_w = -h % multiple, -w % multiple
    if pad_h or pad_w:
        x = F.pad(x, (0, pad_w, 0, pad_h))
    return x


def init_transformer_weights(module):
    """timm/ViT initialisation: trunc-normal(0.02) Linear weights, zero biases, unit norms."""
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def check_arch(arch, arch_zoo, required_keys, name):
    """Resolve an ``arch`` preset name (or alias) or validate a custom dict."""
    if isinstance(arch, str):
        key = arch.lower()
        if key not in arch_zoo:
            raise ValueError(f'{name}: unknown arch {arch!r}; choose one of {sorted(arch_zoo)} '
                             f'or pass a dict with keys {sorted(required_keys)}')
        return dict(arch_zoo[key])
    if not isinstance(arch, dict):
        raise ValueError(f'{name}: arch must be a preset name or a dict, got {type(arch).__name__}')
    missing = set(required_keys) - set(arch)
    if missing:
        raise ValueError(f'{name}: custom arch dict is missing {sorted(missing)} '
                         f'(needs {sorted(required_keys)})')
    return dict(arch)


class OverlapPatchEmbed(nn.Module):
    """Overlapping conv patch embedding (VVT) / patch merging (Pale) + LayerNorm.

    Kernel ``k``, stride ``s`` and padding ``k // 2``, so output sides are
    ``ceil(H / s)`` for every odd ``k = 2s - 1`` (7/4 and 3/2) and any input size.
    Returns the ``(B, H*W, C)`` tokens and ``(H, W)``.
    """

    def __init__(self, in_channels, dim, kernel_size, stride, eps=1e-5):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, kernel_size, stride, padding=kernel_size // 2)
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x):
        x = self.proj(x)
        h, w = x.shape[-2:]
        return self.norm(x.flatten(2).transpose(1, 2)), (h, w)
