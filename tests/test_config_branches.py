"""Weights read on a branch the config decides (`codemods/copying/config_branches.py`):
BLOOM's `pretraining_tp > 1 and slow_but_exact` path slices `self.dense.weight`. The
linears are vLLM's (sharded, quantizable), the source's own torch layers are built for a
config that takes the branch, and a module built for it where a weight is not whole is
refused in one line. Engine-free; the engine runs are in test_faithful_engine.py."""

from __future__ import annotations

import ast
import textwrap

import libcst as cst
import pytest

from codemods.apply import generate
from codemods.copying import config_branches
from codemods.source import class_infos

SOURCE = """
class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tp = config.pretraining_tp
        self.exact = self.tp > 1 and getattr(config, "slow_but_exact", False)
        self.up = nn.Linear(8, 8)
        self.down = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 8)
        self.scale = 1.0

    def forward(self, x):
        if self.exact:
            y = F.linear(x, self.up.weight)
        else:
            y = self.up(x)
        if x.shape[0] > 1:  # decided by the input, not the config
            y = y + self.down.bias
        if self.training:  # not set from the config in __init__
            y = y * self.gate.weight.sum()
        return y
"""


def test_only_a_branch_the_config_decides_frees_its_linear():
    module = cst.parse_module(textwrap.dedent(SOURCE))
    classes = class_infos(module)
    kept, branched = config_branches.linear_reads(module, classes)
    # read on a branch the input or the module's mode decides: torch layers
    assert kept == {"down", "gate"}
    read = branched["Block"]
    assert read.attrs == ("up",)
    assert read.test == "self.exact"
    # the test as `__init__` can read it: from the config, through the attribute chain
    assert read.init_test == (
        '(config.pretraining_tp > 1 and getattr(config, "slow_but_exact", False))'
    )


def test_an_attribute_set_twice_does_not_decide_a_branch():
    src = SOURCE.replace(
        "        self.scale = 1.0\n",
        "        self.scale = 1.0\n\n    def reset(self):\n        self.exact = False\n",
    )
    module = cst.parse_module(textwrap.dedent(src))
    kept, branched = config_branches.linear_reads(module, class_infos(module))
    assert "up" in kept and not branched


def _linear_classes(text: str, cls: str) -> dict[str, str]:
    """{attr: the vLLM class built for it} in `cls.__init__` (the `else` side of a
    construction that depends on the config)."""
    node = next(
        n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == cls
    )
    out = {}
    for a in ast.walk(node):
        if isinstance(a, ast.Assign) and isinstance(a.targets[0], ast.Attribute):
            value = a.value.orelse if isinstance(a.value, ast.IfExp) else a.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
                if value.func.id.endswith("Linear"):
                    out[a.targets[0].attr] = value.func.id
    return out


@pytest.fixture(scope="module")
def bloom():
    return generate("modeling_bloom.py")


def test_bloom_is_sharded_with_the_source_path_kept(bloom):
    plan, text = bloom
    assert _linear_classes(text, "BloomAttention") == {
        "query_key_value": "ColumnParallelLinear",
        "dense": "RowParallelLinear",
    }
    assert _linear_classes(text, "BloomMLP") == {
        "dense_h_to_4h": "ColumnParallelLinear",
        "dense_4h_to_h": "RowParallelLinear",
    }
    # the source's own layer where the config takes the branch reading its weight
    assert (
        "nn.Linear(4 * hidden_size, hidden_size)\n"
        "            if config.pretraining_tp > 1 and config.slow_but_exact\n"
        "            else RowParallelLinear("
    ) in text
    # the branch itself as the source writes it
    assert "self.dense_4h_to_h.weight[" in text
    assert text.count("source_layers_for(\n") == 2
    report = plan.report()
    line = next(r for r in report if r.startswith("Unfused: config branch (BloomMLP)"))
    assert (
        "`self.pretraining_tp > 1 and self.slow_but_exact` reads dense_4h_to_h" in line
    )
    assert not [r for r in report if r.startswith("Unfused: tensor parallel")], report


def _helper(tp_size: int):
    from torch import nn

    class ColumnParallelLinear(nn.Linear):
        pass

    class RowParallelLinear(nn.Linear):
        pass

    scope = {
        "nn": nn,
        "ColumnParallelLinear": ColumnParallelLinear,
        "RowParallelLinear": RowParallelLinear,
        "get_tensor_model_parallel_world_size": lambda: tp_size,
    }
    exec(config_branches.HELPER, scope)
    sharded = nn.Module()
    sharded.up = ColumnParallelLinear(4, 4)
    whole = nn.Module()
    whole.up = nn.Linear(4, 4)
    return scope["source_layers_for"], sharded, whole


def test_a_config_taking_the_branch_is_served_where_weights_are_whole():
    check, sharded, whole = _helper(tp_size=1)
    check(sharded, "self.exact", None)  # TP 1: every layer whole
    check, sharded, whole = _helper(tp_size=2)
    check(whole, "self.exact", None)  # replicated: whole on every rank
    with pytest.raises(ValueError, match="tensor parallel size 2") as err:
        check(sharded, "self.exact", None)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="without quantization"):
        _helper(tp_size=1)[0](whole, "self.exact", object())
