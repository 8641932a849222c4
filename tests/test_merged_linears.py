"""Two linears a copied class calls on one tensor become one MergedColumnParallelLinear
(`codemods/copying/merged_linears.py`), where the gated-MLP pattern refused the class.
Engine-free; the rows they changed ran in vLLM at TP=1 and TP=2 (`verify gemma3n
--tp 2`: 5.7e-06; bitnet, falcon_h1, lfm2, lfm2_moe, llama4, longcat_flash, xglm: their
coverage rows)."""

from __future__ import annotations

import libcst as cst
import torch
from torch import nn

from codemods.copying import merged_linears
from codemods.source import class_infos
from conftest import REPO

MLP = """
class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        gate = self.gate_proj(x)
        {between}
        return self.down_proj(gate * self.up_proj(x))
"""


def _info(between: str = "pass"):
    return class_infos(cst.parse_module(MLP.replace("{between}", between)))["MLP"]


def test_two_linears_on_one_name_are_found_with_the_second_ones_size():
    assert merged_linears.find(_info(), set()) == (
        ("gate_proj", "up_proj"),
        "config.intermediate_size",
    )


def test_a_name_reassigned_between_the_calls_is_not_one_tensor():
    assert merged_linears.find(_info("x = x * 2"), set()) is None
    assert merged_linears.find(_info("x += 1"), set()) is None


def test_a_linear_a_claim_took_is_not_merged():
    assert merged_linears.find(_info(), {"up_proj"}) is None


class _Shifted(nn.Module):
    """up reads another tensor than gate: the names alone would not tell."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(8, 16), nn.Linear(8, 16)

    def forward(self, x):
        return self.gate_proj(x) * self.up_proj(x + 1)


def test_the_proof_runs_the_module_and_compares_what_each_linear_read():
    x = torch.randn(1, 3, 8)
    call = ((x,), {}, None)
    assert not merged_linears.read_one_tensor(
        _Shifted(), call, ("gate_proj", "up_proj")
    )
    same = _Shifted()
    same.forward = lambda x: same.gate_proj(x) * same.up_proj(x)
    assert merged_linears.read_one_tensor(same, call, ("gate_proj", "up_proj"))


def _init_of(model: str, cls: str) -> str:
    text = (REPO / "generated" / f"{model}.py").read_text()
    body = text[text.index(f"class {cls}") :]
    return body[: body.index("\nclass ")]


def test_committed_merges_shard_as_the_class_does():
    # Gemma 3n: sharded on its dense layers only, as its MLP is
    mlp = _init_of("gemma3n", "Gemma3nTextMLP")
    assert "self.gate_up_proj = MergedColumnParallelLinear(" in mlp
    assert "[self.intermediate_size, self.intermediate_size]" in mlp
    assert (
        mlp.count("disable_tp=config.activation_sparsity_pattern[layer_idx] != 0.0")
        == 2
    )
    assert "self.gate_up_proj.output_partition_sizes" in mlp
    assert "self.up_proj" not in mlp
    # BitNet: its MLP never shards (a norm over the whole intermediate width)
    mlp = _init_of("bitnet", "BitNetMLP")
    assert "self.gate_up_proj = MergedColumnParallelLinear(" in mlp
    assert "disable_tp=True," in mlp
