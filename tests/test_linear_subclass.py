"""A subclass of nn.Linear computing a linear -> vLLM's linear, as nn.Linear is
(`fusion_patterns/linear_subclass.py`): proven with and without a bias against
F.linear; one computing anything else is copied and said. Engine-free."""

from __future__ import annotations

import libcst as cst
import torch
from torch import nn

from codemods.apply import generate
from codemods.source import class_infos
from fusion_patterns import linear_subclass
from fusion_patterns.base import Refusal


class _NoCalls:
    def call(self, instance):
        return None


def _info(name: str):
    src = (
        f"class {name}(nn.Linear):\n"
        "    def forward(self, input):\n"
        "        return input\n"
    )
    return class_infos(cst.parse_module(src))[name]


class Written(nn.Linear):  # Falcon's form: the product, then the bias if any
    def forward(self, input):
        out = input @ self.weight.T
        return out if self.bias is None else out + self.bias


class BiasDropped(nn.Linear):
    def forward(self, input):
        return input @ self.weight.T


class Grouped(nn.Linear):  # block-diagonal: each half of the input to its half
    def forward(self, input):
        a, b = input.chunk(2, -1)
        wa, wb = self.weight.chunk(2, 0)
        return torch.cat([a @ wa[:, : a.shape[-1]].T, b @ wb[:, a.shape[-1] :].T], -1)


class Scaled(nn.Linear):
    def forward(self, input):
        return super().forward(input) * 1.0001


def test_the_product_written_out_is_a_linear():
    spec = linear_subclass.prove(_NoCalls(), _info("Written"), Written(16, 8))
    assert not isinstance(spec, Refusal), spec
    assert spec.error <= linear_subclass.RTOL


def test_a_forward_computing_something_else_is_refused_with_its_difference():
    # the tiny model may build it without a bias: the proof adds one to see it used
    for cls in (BiasDropped, Grouped, Scaled):
        instance = cls(16, 8, bias=False)
        spec = linear_subclass.prove(_NoCalls(), _info(cls.__name__), instance)
        assert isinstance(spec, Refusal), cls
        assert spec.reason.startswith(
            "its forward does not compute F.linear(x, self.weight, self.bias) "
            "(relative difference "
        ), spec.reason


def test_falcon_builds_vllms_linears_and_shards_its_mlp():
    plan, text = generate("modeling_falcon.py")
    assert "class FalconLinear" not in text and "FalconLinear(" not in text
    assert "self.dense_h_to_4h = ColumnParallelLinear(" in text
    assert "self.dense_4h_to_h = RowParallelLinear(" in text
    fused = [line for line in plan.report() if line.startswith("Fused: FalconLinear")]
    assert {line.split(" -> ")[1].split(" ")[0] for line in fused} == {
        "dense_h_to_4h",
        "dense_4h_to_h",
        "query_key_value",
        "dense",
    }, fused
    assert not any("not a vLLM linear it can shard" in line for line in plan.report())
