"""A module class computing an activation -> vLLM's activation op
(`fusion_patterns/activation.py`): proven on random inputs against each of vLLM's
activations, the exact form kept (GELU's erf form and its tanh approximation are never
taken for each other), a near miss copied and said. Engine-free."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from codemods.apply import generate
from fusion_patterns import activation
from fusion_patterns.base import Refusal


class _NoCalls:
    def call(self, instance):
        return None


class Formula(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _tanh_gelu(c=0.79788456, scale=1.0):
    return (
        lambda x: scale * x * 0.5 * (1.0 + torch.tanh(c * x * (1 + 0.044715 * x * x)))
    )


@pytest.fixture(scope="module", autouse=True)
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.mark.parametrize(
    "fn, name",
    [
        (_tanh_gelu(), "gelu_pytorch_tanh"),  # BLOOM's constants, written its way
        (lambda x: 0.5 * x * (1 + torch.erf(x / math.sqrt(2))), "gelu"),
        (lambda x: x * torch.sigmoid(x), "silu"),
        (lambda x: x * torch.sigmoid(1.702 * x), "quick_gelu"),
        (lambda x: torch.relu(x) ** 2, "relu2"),
    ],
    ids=["bloom_tanh_gelu", "erf_gelu", "silu", "quick_gelu", "relu2"],
)
def test_each_form_is_vllms_op_for_it(fn, name):
    spec = activation.prove(_NoCalls(), _info("Act"), Formula(fn))
    assert not isinstance(spec, Refusal), spec
    assert spec.vllm_name == name and spec.error <= activation.RTOL


@pytest.mark.parametrize(
    "fn",
    [
        _tanh_gelu(c=0.7),  # the approximation's constant off
        _tanh_gelu(scale=1.001),  # a tenth of a percent off
        lambda x: x * torch.sigmoid(1.5 * x),  # a gated sigmoid with its own slope
    ],
    ids=["constant_off", "scaled", "own_slope"],
)
def test_a_near_miss_is_refused_with_the_closest_op(fn):
    spec = activation.prove(_NoCalls(), _info("Act"), Formula(fn))
    assert isinstance(spec, Refusal)
    assert spec.reason.startswith("computes none of vLLM's activations (closest: ")


def _info(name: str):
    import libcst as cst

    from codemods.source import class_infos

    src = f"class {name}(nn.Module):\n    def forward(self, x):\n        return x\n"
    return class_infos(cst.parse_module(src))[name]


def test_bloom_runs_vllms_tanh_gelu():
    plan, text = generate("modeling_bloom.py")
    assert 'self.gelu_impl = get_act_fn("gelu_pytorch_tanh")' in text
    # the custom autograd function and its helpers are gone with the class
    for gone in ("class BloomGelu", "GeLUFunction", "bloom_gelu_forward"):
        assert gone not in text
    assert any(
        line.startswith(
            'Fused: BloomGelu (BloomMLP) -> gelu_impl (get_act_fn("gelu_pytorch_tanh"), '
            "within "
        )
        for line in plan.report()
    ), plan.report()


def test_a_stateless_module_that_is_not_element_wise_is_no_candidate():
    """A LayerNorm without weights holds no state and takes one tensor, but normalises
    over a row: not an activation, and not said to be one."""
    norm = nn.LayerNorm(64, elementwise_affine=False)
    assert activation.prove(_NoCalls(), _info("Norm"), norm) is None


def test_names_map_to_the_vllm_op_of_the_same_function():
    from fusion_patterns.activation_names import vllm_names

    names = dict(vllm_names())
    # GPT-2's seven-op tanh GELU: torch's one-kernel tanh GELU, never the erf form
    assert names["gelu_new"] == names["gelu_fast"] == "gelu_pytorch_tanh"
    assert names["gelu"] == names["gelu_python"] == "gelu"
    assert names["swish"] == "silu" and names["relu"] == "relu"
    # a clipped GELU, a leaky ReLU, a learned one: no vLLM op computes them
    for own in ("gelu_10", "leaky_relu", "prelu", "xielu", "mish"):
        assert own not in names


def test_gpt2_builds_its_activation_by_name_through_vllms_ops():
    plan, text = generate("modeling_gpt2.py")
    assert "self.act = act_fn(config.activation_function)" in text
    assert "= ACT2FN[" not in text
    assert '    "gelu_new": "gelu_pytorch_tanh",\n' in text
    assert "def act_fn(name) -> nn.Module:" in text
    assert (
        "Fused: ACT2FN[config.activation_function] (GPT2MLP) -> act "
        "(act_fn(config.activation_function), vLLM's op for the 14 names one computes)"
    ) in plan.report()
