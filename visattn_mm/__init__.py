"""Efficient-attention vision backbones for mmdet and mmseg."""
