"""A sharded copied class is proven on every combination of the branches its config
decides, not only the tiny config's (`codemods/copying/other_branches.py`): a branch
whose other way breaks the sharding pins the class to the way proven (whole on every
rank elsewhere), one whose other way holds leaves it sharded. Engine-free; the TP=2 run
of MiniCPM3 with `q_lora_rank=None` is `python -m codemods.verify minicpm3 --tp 2
--override q_lora_rank=null` (the file before this pin: tokens differ, 3.1 logprob)."""

from __future__ import annotations

import pytest

from codemods.apply import generate
from codemods.copying.config_branches import DecidedBranch, negated
from codemods.copying.other_branches import Branches, other_branches
from codemods.source import load


@pytest.fixture(scope="module")
def minicpm3():
    return generate("modeling_minicpm3.py")


def _tp_line(plan, cls: str) -> str:
    """The report's one tensor-parallel line for `cls`."""
    (line,) = [
        u.describe()
        for u in plan.unfused
        if u.source_class == cls and u.what == "tensor parallel"
    ]
    return line


def _init_of(text: str, cls: str) -> str:
    """`cls`'s source in the generated file, up to its forward."""
    body = text[text.index(f"class {cls}") :]
    return body[: body.index("def forward")]


def test_a_branch_whose_other_way_breaks_the_sharding_pins_the_class(minicpm3):
    plan, text = minicpm3
    (line,) = [
        u.describe()
        for u in plan.unfused
        if u.source_class == "MiniCPM3Attention" and "sharded where" in u.reason
    ]
    # the other way (a plain q_proj, whole) was run sharded and failed
    assert "`config.q_lora_rank is not None`" in line, line
    assert "with config.q_lora_rank=None over 2 ranks it fails" in line, line
    attention = text[text.index("class MiniCPM3Attention") :]
    attention = attention[: attention.index("\nclass ")]
    assert attention.count("disable_tp=config.q_lora_rank is None,") == 3
    assert "if config.q_lora_rank is not None\n            else 1" in attention


def test_a_branch_whose_other_way_holds_leaves_the_class_sharded():
    # MPT's `clip_qkv` clamps q/k/v elementwise: both ways shard alike
    plan, text = generate("modeling_mpt.py")
    assert "disable_tp=" not in text
    assert not [u for u in plan.unfused if "sharded where" in u.reason]


def test_an_edited_branch_the_tiny_config_does_not_take_is_caught(tmp_path):
    """Phi's tiny config takes `qk_layernorm`; an `else:` that counts the query heads
    from the config is run only on the other way: the merged q/k/v (which shards by
    heads) and the copied attention are pinned to the way proven, naming that config."""
    from conftest import edited_modeling_file

    old = "            key_states = self.k_layernorm(key_states)\n"
    new = old + (
        "        else:\n"
        "            query_states = query_states.flatten(1, 2).view(\n"
        "                query_states.shape[0], self.config.num_attention_heads, -1,"
        " self.head_dim\n"
        "            )\n"
    )
    path = edited_modeling_file(tmp_path, "modeling_phi.py", old, new)
    plan, text = generate(str(path), trust_remote_code=True)
    line = _tp_line(plan, "PhiAttention")
    assert "sharded where `config.qk_layernorm` (proven there)" in line, line
    assert "config.qk_layernorm=False over 2 ranks it fails" in line, line
    attention = _init_of(text, "PhiAttention")
    assert "self.qkv_proj = QKVParallelLinear(" in attention
    # the merged q/k/v and the output projection, both whole on the other way
    assert attention.count("disable_tp=not config.qk_layernorm,") == 2


def _attention(name: str, cls: str, config):
    import importlib

    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    info = load(f"modeling_{name}.py").classes[cls]
    return info, getattr(module, cls)(config, 0)


def test_the_other_way_is_rebuilt_and_run_on_the_tiny_calls_inputs():
    import torch
    from transformers import MptConfig

    config = MptConfig(d_model=64, n_heads=4, n_layers=1, vocab_size=32)
    config.attn_config.clip_qkv = 0.5
    info, attention = _attention("mpt", "MptAttention", config)
    hidden = torch.randn(1, 5, 64)
    call = ((hidden,), {"position_bias": None}, attention(hidden, None))
    branches = other_branches(info, attention, call, config)
    assert [b.config for b in branches.decided] == ["config.attn_config.clip_qkv"]
    (other,) = branches.others
    assert other.label == "config.attn_config.clip_qkv=None"
    assert other.instance.clip_qkv is None and attention.clip_qkv == 0.5
    # its output is its own on the same inputs, not the tiny instance's
    assert not torch.equal(other.call[2][0], call[2][0])


def test_a_branch_no_config_can_take_the_other_way_is_not_pinned():
    # GPT-J's `rotary_dim` is an int field: GPTJConfig rejects None, so `rotary_dim is
    # not None` is taken by every config there is
    from transformers import GPTJConfig

    config = GPTJConfig(n_embd=64, n_head=4, n_layer=1, vocab_size=32, rotary_dim=8)
    info, attention = _attention("gptj", "GPTJAttention", config)
    branches = other_branches(info, attention, None, config)
    assert branches.decided == [] and branches.others == []


def _branches(count: int) -> Branches:
    return Branches([DecidedBranch(f"config.f{i}", True) for i in range(count)], [])


def test_only_the_branches_whose_flip_fails_are_pinned():
    branches = _branches(3)
    assert branches.pinned({frozenset({1})}) == "config.f1"
    assert branches.pinned({frozenset({1}), frozenset({1, 2})}) == "config.f1"


def test_a_combination_failing_without_a_pinned_branch_pins_them_all():
    branches = _branches(3)
    every = "config.f0 and config.f1 and config.f2"
    assert branches.pinned({frozenset({0}), frozenset({1, 2})}) == every
    assert branches.pinned({frozenset({0, 1, 2})}) == every


@pytest.mark.parametrize(
    "test, want",
    [
        ("(config.q_lora_rank is None)", "(config.q_lora_rank is not None)"),
        ("config.x is not None", "config.x is None"),
        ('config.gating == "per-head"', 'config.gating != "per-head"'),
        ("not config.multi_query", "config.multi_query"),
        ("config.multi_query", "not config.multi_query"),
        ("config.a and config.b", "not (config.a and config.b)"),
        ("config.pretraining_tp > 1", "not (config.pretraining_tp > 1)"),
    ],
)
def test_a_negated_test_reads_as_the_source_would_write_it(test, want):
    assert negated(test) == want


def test_a_class_failing_on_the_tiny_configs_way_is_sharded_where_another_way_holds():
    # StableLM's per-head q/k layernorms (its tiny config's way) index every head on
    # each rank; without them (StableLM 2 1.6B) the attention shards as vLLM's does
    plan, text = generate("modeling_stablelm.py")
    line = _tp_line(plan, "StableLmAttention")
    assert "sharded where `not config.qk_layernorm` (proven with " in line, line
    assert "config.qk_layernorm=False), whole on every rank elsewhere" in line, line
    attention = _init_of(text, "StableLmAttention")
    # the merged q/k/v, pinned as the copy is (`verify stablelm --tp 2 [--override
    # qk_layernorm=false]`: 3.3e-06, 2.9e-06)
    assert attention.count("disable_tp=config.qk_layernorm,") == 2  # qkv, o
    assert "self.qkv_proj = QKVParallelLinear(" in attention
    assert "self.o_proj = RowParallelLinear(" in attention


def test_a_merged_qkv_of_a_class_that_never_shards_is_whole_on_every_rank():
    # BitNet's sub-norm over the whole attention output fails every sharding: its
    # q/k/v are still one GEMM, whole on every rank (`verify bitnet --tp 2`: 3.8e-06)
    plan, text = generate("modeling_bitnet.py")
    attention = _init_of(text, "BitNetAttention")
    assert "self.qkv_proj = QKVParallelLinear(" in attention
    assert "disable_tp=True," in attention
    assert "self.o_proj = ReplicatedLinear(" in attention
    line = _tp_line(plan, "BitNetAttention")
    assert "replicated: sharded over 2 ranks it fails" in line, line


def test_ways_taken_together_are_said_in_as_few_tests_as_they_need():
    branches = _branches(2)
    # f0 flipped, with f1 either way: f1 is not tested
    assert branches.any_of([frozenset({0}), frozenset({0, 1})]) == "not config.f0"
    assert branches.any_of([frozenset({0})]) == "not config.f0 and config.f1"
    assert branches.any_of([frozenset({0}), frozenset({1})]) == (
        "(not config.f0 and config.f1) or (config.f0 and not config.f1)"
    )


def test_a_way_that_builds_none_of_the_sharded_linears_proves_nothing():
    from types import SimpleNamespace

    from codemods.copying.other_branches import OtherBranch

    def failures(instance, plan):
        other = OtherBranch(frozenset({0}), "config.f0=False", instance, ())
        return Branches(_branches(1).decided, [other]).failures(plan, lambda o: None)

    plan = {"q_proj": "colwise", "o_proj": "rowwise"}
    bare = SimpleNamespace(q_proj=None, o_proj=None)
    built = SimpleNamespace(q_proj=object(), o_proj=None)
    assert "builds none of the linears" in failures(bare, plan)[frozenset({0})]
    assert failures(built, plan) == {}
    # a plan that shards nothing (gathered outputs) is as proven as on the tiny way
    gathered = {"q_proj": "colwise_gather_output"}
    assert failures(bare, gathered) == {}
