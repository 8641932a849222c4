"""Fusion patterns: one module per fusion, each a libcst matcher over transformers
modeling sources plus what it contributes to the generated file's tables."""

from . import glu, qkv, residual_norm, rms_norm

ALL = (rms_norm, qkv, glu, residual_norm)
