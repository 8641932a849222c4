"""Grouped kv heads: the tiny configs hold a kv-head count below the head count, found
by the field's role (Falcon's `num_kv_heads` is no size name the rules know), and an
attention that broadcasts its keys to every query head (Falcon's new decoder
architecture) hands vLLM the count it really hands over, on every branch, or is refused.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
import pytest
import torch

from conftest import run_cli

FALCON_COUNT = (
    "        num_kv_heads = self.num_heads if self.new_decoder_architecture "
    "else self.num_kv_heads\n"
)
FALCON_RESHAPES = (
    "        key_layer = key_layer.transpose(1, 2).reshape(batch_size, num_kv_heads, "
    "query_length, self.head_dim)\n"
    "        value_layer = value_layer.transpose(1, 2).reshape(batch_size, num_kv_heads, "
    "query_length, self.head_dim)\n"
)


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
    """The source text of `keyword=` in the vLLM `Attention(...)` built by `class_name`."""
    module = cst.parse_module(text)
    (cls,) = m.findall(module, m.ClassDef(name=m.Name(class_name)))
    for call in m.findall(cls, m.Call(func=m.Name("Attention"))):
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == keyword:
                return module.code_for_node(arg.value)
    raise AssertionError(f"no Attention({keyword}=...) in {class_name}")


@pytest.mark.parametrize(
    "flags",
    [
        {"new_decoder_architecture": True, "num_kv_heads": 2},  # Falcon-40B/180B
        {"new_decoder_architecture": True, "num_kv_heads": 1},
        {"new_decoder_architecture": False, "multi_query": True},  # Falcon-7B
        {"new_decoder_architecture": False, "multi_query": False},  # Falcon-RW
    ],
)
def test_falcon_hands_vllm_the_kv_heads_its_source_hands_its_attention(flags):
    """The generated count, evaluated on a transformers FalconAttention of each layout,
    equals the heads of the key the source's own split hands its attention."""
    from codemods.apply import generate

    plan, text = generate("modeling_falcon.py")
    expr = _attention_argument(text, "FalconAttention", "num_kv_heads")
    config = _falcon().config_class(
        vocab_size=64, hidden_size=256, num_attention_heads=4, **flags
    )
    from transformers.models.falcon.modeling_falcon import FalconAttention

    attention = FalconAttention(config, layer_idx=0)
    fused = attention.query_key_value(torch.randn(1, 3, 256))
    _, key, _ = attention._split_heads(fused)  # [batch, tokens, heads, head size]
    handed = key.transpose(1, 2).reshape(1, -1, 3, attention.head_dim).shape[1]
    if flags["new_decoder_architecture"]:
        # the keys broadcast to every query head before the attention
        assert handed == config.num_attention_heads
    assert eval(expr, {"self": attention}) == handed  # noqa: S307 - the generated text
    (line,) = [
        u.describe()
        for u in plan.unfused
        if u.source_class == "FalconAttention" and u.what == "attention"
    ]
    assert "broadcast from 2 to 4 heads before it" in line, line


def test_a_broadcast_no_expression_counts_is_refused(tmp_path):
    """A planted variant: the source counts its broadcast kv heads implicitly (`-1`), so
    only the query head count matches on the probed branch (and breaks Falcon-7B's
    single kv head): refused, in one line, nothing written."""
    from codemods.source import resolve

    text = resolve("modeling_falcon.py").read_text()
    old = FALCON_COUNT + "        # 3 x"
    assert old in text and FALCON_RESHAPES in text
    head, tail = text.split(old, 1)
    tail = tail.replace(
        FALCON_RESHAPES, FALCON_RESHAPES.replace("num_kv_heads", "-1"), 1
    )
    edited = tmp_path / "src" / "modeling_falcon.py"
    edited.parent.mkdir()
    edited.write_text(head + "        # 3 x" + tail)
    out = tmp_path / "out"
    result = run_cli(
        "codemods.apply", str(edited), "--trust-remote-code", "--out", str(out)
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "error: cannot generate: FalconAttention broadcasts its keys and values from "
        "2 to 4 heads before its attention, and no expression of the source counts"
    ), lines[0]
    assert not out.exists() or not list(out.iterdir())
