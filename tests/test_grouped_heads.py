"""Grouped kv heads: the tiny configs hold a kv-head count below the head count, found
by the field's role (Falcon's `num_kv_heads` is no size name the rules know), and an
attention that broadcasts its keys to every query head (Falcon's new decoder
architecture) hands vLLM the count it really hands over, on every branch.
"""

from __future__ import annotations

import re

import libcst as cst
import libcst.matchers as m
import pytest
import torch


def _falcon():
    from transformers import FalconForCausalLM

    return FalconForCausalLM


def test_a_kv_head_count_at_the_head_count_goes_below_it_by_its_role():
    from codemods import grouped_heads, tiny

    cls = _falcon()
    plain = tiny.tiny_values(cls.config_class, None, tiny.source_layer_kinds(cls))
    # the class's own default (None -> the head count): equality, unless the rule acts
    assert "num_kv_heads" not in plain
    assert cls.config_class(**plain).num_kv_heads == plain["num_attention_heads"]
    assert grouped_heads.kv_head_values(cls, plain) == {"num_kv_heads": 2}
    values = tiny.working_values(cls)
    assert values["new_decoder_architecture"] is True
    assert 1 <= values["num_kv_heads"] < values["num_attention_heads"]


def test_latent_attention_keeps_its_kv_heads_at_the_head_count():
    # MLA expands one latent into a key and value per head: equality is the source's
    from transformers import DeepseekV3ForCausalLM

    from codemods import grouped_heads, tiny

    cls = DeepseekV3ForCausalLM
    values = tiny.working_values(cls)
    assert values["num_key_value_heads"] == values["num_attention_heads"]
    assert grouped_heads.kv_head_values(cls, values) == {}


def test_a_field_that_shapes_no_attention_is_not_a_kv_head_count():
    # Qwen3's kv heads are already below its heads; no other field equal to the head
    # count shrinks an attention weight alone (the layer count, 4, shrinks every layer)
    from transformers import Qwen3ForCausalLM

    from codemods import grouped_heads, tiny

    cls = Qwen3ForCausalLM
    values = tiny.tiny_values(cls.config_class, None, tiny.source_layer_kinds(cls))
    assert values["num_hidden_layers"] == values["num_attention_heads"]
    assert grouped_heads.kv_head_values(cls, values) == {}


def _attention_argument(text: str, class_name: str, keyword: str) -> str:
    """The source text of `keyword=` in the vLLM `Attention(...)` built by `class_name`,
    with each local it reads (a count captured before the per-rank divisions) replaced
    by the expression assigned to it, and one rank (`tp_size` 1)."""
    module = cst.parse_module(text)
    (cls,) = m.findall(module, m.ClassDef(name=m.Name(class_name)))
    assigned = {
        target.target.value: module.code_for_node(node.value)
        for node in m.findall(cls, m.Assign(targets=[m.AssignTarget(m.Name())]))
        for target in node.targets
    }
    assigned["tp_size"] = "1"
    for call in m.findall(cls, m.Call(func=m.Name("Attention"))):
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == keyword:
                expr = module.code_for_node(arg.value)
                for name in sorted(set(re.findall(r"(?<![.\w])[A-Za-z_]\w*", expr))):
                    if name in assigned:
                        expr = re.sub(
                            rf"(?<![.\w]){name}\b", f"({assigned[name]})", expr
                        )
                return expr
    raise AssertionError(f"no Attention({keyword}=...) in {class_name}")


LAYOUTS = [
    {"new_decoder_architecture": True, "num_kv_heads": 2},  # Falcon-40B/180B
    {"new_decoder_architecture": True, "num_kv_heads": 1},
    {"new_decoder_architecture": False, "multi_query": True},  # Falcon-7B
    {"new_decoder_architecture": False, "multi_query": False},  # Falcon-RW
]


def _handed_and_counted(expr: str, flags: dict) -> tuple[int, int]:
    """(kv heads the source's own split hands its attention, `expr` evaluated on the
    same transformers FalconAttention) for one Falcon layout."""
    from transformers.models.falcon.modeling_falcon import FalconAttention

    config = _falcon().config_class(
        vocab_size=64, hidden_size=256, num_attention_heads=4, **flags
    )
    attention = FalconAttention(config, layer_idx=0)
    fused = attention.query_key_value(torch.randn(1, 3, 256))
    _, key, _ = attention._split_heads(fused)  # [batch, tokens, heads, head size]
    handed = key.transpose(1, 2).reshape(1, -1, 3, attention.head_dim).shape[1]
    return handed, eval(expr, {"self": attention})  # noqa: S307 - generated text


@pytest.fixture(scope="module")
def falcon():
    from codemods.apply import generate

    return generate("modeling_falcon.py")


@pytest.mark.parametrize("flags", LAYOUTS)
def test_falcon_hands_vllm_the_kv_heads_its_source_hands_its_attention(falcon, flags):
    """The generated count, evaluated on a transformers FalconAttention of each layout,
    equals the heads of the key the source's own split hands its attention."""
    plan, text = falcon
    expr = _attention_argument(text, "FalconAttention", "num_kv_heads")
    handed, counted = _handed_and_counted(expr, flags)
    if flags["new_decoder_architecture"]:
        # the keys broadcast to every query head before the attention
        assert handed == 4
    assert counted == handed
    (line,) = [
        u.describe()
        for u in plan.unfused
        if u.source_class == "FalconAttention" and u.what == "attention"
    ]
    assert "broadcast from 2 to 4 heads before it" in line, line


def test_the_count_the_weights_hold_is_caught_where_keys_are_broadcast():
    """The planted bug (the file before this fix): vLLM told the kv heads the weights
    hold while the source broadcasts them to every query head."""
    wrong = [_handed_and_counted("self.num_kv_heads", f) for f in LAYOUTS[:2]]
    assert all(handed != counted for handed, counted in wrong), wrong
