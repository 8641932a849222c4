"""What a rank's share counts (`engine.body_bytes`, the TP=2 column of COVERAGE.md):
checkpoint tensors once; not the copies vLLM's MLA layer makes of its kv_b_proj."""

from __future__ import annotations

import torch
from torch import nn


def _mla_layer(**params: torch.Tensor) -> nn.Module:
    """A vLLM MLAAttention as its loader leaves it: parameters set after loading
    (building a real one needs a running vLLM config; only its type matters here)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = MLAAttention.__new__(MLAAttention)
    nn.Module.__init__(layer)
    for name, value in params.items():
        layer.register_parameter(name, nn.Parameter(value, requires_grad=False))
    return layer


def test_the_mla_layer_s_relaid_kv_b_proj_is_not_counted_again():
    from codemods.engine import body_bytes

    model = nn.Module()
    model.kv_b_proj = nn.Linear(4, 6, bias=False)  # 24 floats: the checkpoint's
    model.attn = _mla_layer(W_UV=torch.zeros(2, 3, 2), W_UK_T=torch.zeros(2, 2, 3))
    assert body_bytes(model) == 24 * 4
    # the same names on another module are its own weights, counted
    model.other = nn.Module()
    model.other.register_parameter("W_UV", nn.Parameter(torch.zeros(5)))
    assert body_bytes(model) == (24 + 5) * 4
