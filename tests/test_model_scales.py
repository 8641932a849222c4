"""The patterns that keep the source's arithmetic outside the fusions (embedding and
logits scales, soft-caps, residual multipliers, sandwich norms) and read packed
projections, on real transformers sources and edited copies. Engine-free: matching only.
"""

from __future__ import annotations

import pytest

from conftest import edited_modeling_file

from codemods.errors import CodemodError
from fusion_patterns.base import code
from codemods.plan import plan
from codemods.source import load
from codemods.structure import analyse


def edited(tmp_path, name: str, old: str, new: str):
    return load(str(edited_modeling_file(tmp_path, name, old, new)))


def test_granite_multipliers_are_read_from_the_source():
    s = analyse(load("modeling_granite.py"))
    assert [b.multiplier for b in s.layer_spec.blocks] == [
        "self.residual_multiplier"
    ] * 2
    assert s.embed_scale.factor == "self.embedding_multiplier"
    assert not s.embed_scale.in_embedding  # applied to given inputs_embeds too
    assert s.embed_scale.init_lines == (
        "self.embedding_multiplier = config.embedding_multiplier",
    )
    assert (s.logits.scale, s.logits.soft_cap) == (
        "1.0 / (self.config.logits_scaling)",
        None,
    )


def test_gemma2_sandwich_norms_and_soft_cap():
    s = analyse(load("modeling_gemma2.py"))
    assert [(b.norm, b.post_norms) for b in s.layer_spec.blocks] == [
        ("input_layernorm", ("post_attention_layernorm",)),
        ("pre_feedforward_layernorm", ("post_feedforward_layernorm",)),
    ]
    assert s.logits.soft_cap == "self.config.final_logit_softcapping"
    assert s.logits.scale is None
    # the scale lives in the embedding class, taken from its construction
    assert s.embed_scale.in_embedding and s.embed_scale.cast
    assert s.embed_scale.init_lines == (
        "self.embed_scale = self.config.hidden_size**0.5",
    )


def test_gemma3_head_norms_and_rope_per_layer_type():
    s = analyse(load("modeling_gemma3.py"))
    assert s.attention.q_norm.attr == "q_norm" and s.attention.k_norm.attr == "k_norm"
    assert s.rope_by_layer_type
    # llama indexes rope_parameters by string keys only: one rope for all layers
    assert not analyse(load("modeling_llama.py")).rope_by_layer_type


def test_phi3_packed_projections_stack_nothing():
    p = plan(analyse(load("modeling_phi3.py")))
    assert p.structure.attention.packed and p.structure.mlps["Phi3MLP"].packed
    assert p.packed_modules_mapping() == {
        "qkv_proj": ["qkv_proj"],
        "gate_up_proj": ["gate_up_proj"],
    }
    assert p.stacked_params() == []


def test_gpt_neox_per_head_packing_is_reordered_at_load():
    p = plan(analyse(load("modeling_gpt_neox.py")))
    attention = p.structure.attention
    assert attention.packed and attention.interleaved
    assert attention.merged == "query_key_value"
    # heads derived from the source's own sizes: 3 * hidden_size over 3 * head_size
    assert code(attention.num_heads) == "(config.hidden_size) // self.head_size"
    assert p.packed_modules_mapping() == {"query_key_value": ["query_key_value"]}
    assert p.stacked_params() == []


def test_reorder_interleaved_gives_q_k_v_blocks():
    import torch

    from fusion_patterns.qkv import reorder_interleaved

    heads, size = 3, 2
    # row r of head h, role j (0 q, 1 k, 2 v) holds 100 * j + 10 * h + r
    packed = torch.tensor(
        [
            100 * j + 10 * h + r
            for h in range(heads)
            for j in range(3)
            for r in range(size)
        ]
    )
    want = torch.tensor(
        [
            100 * j + 10 * h + r
            for j in range(3)
            for h in range(heads)
            for r in range(size)
        ]
    )
    assert torch.equal(reorder_interleaved(packed, heads), want)


@pytest.mark.parametrize(
    "name, old, new, reason",
    [
        (
            "modeling_gemma2.py",
            "        if self.config.final_logit_softcapping is not None:",
            "        logits = logits * 2.0\n"
            "        if self.config.final_logit_softcapping is not None:",
            "before a soft-cap",
        ),
        (
            "modeling_gemma2.py",
            "            logits = torch.tanh(logits)\n",
            "            logits = torch.sigmoid(logits)\n",
            "on the logits",
        ),
        (
            "modeling_granite.py",
            "inputs_embeds = inputs_embeds * self.embedding_multiplier",
            "inputs_embeds = inputs_embeds / self.embedding_multiplier",
            "divides the embeddings",
        ),
        (
            "modeling_granite.py",
            "        hidden_states = self.norm(hidden_states)\n",
            "        hidden_states = self.norm(hidden_states) * 2\n",
            "on the model's streams",
        ),
        (
            "modeling_granite.py",
            "        hidden_states = outputs.last_hidden_state\n",
            "        hidden_states = outputs.last_hidden_state * 0.5\n",
            "before the head",
        ),
    ],
)
def test_unhandled_arithmetic_refuses_generation(tmp_path, name, old, new, reason):
    with pytest.raises(CodemodError, match=reason):
        analyse(edited(tmp_path, name, old, new))


def test_a_plain_embedding_class_leaves_the_scale_to_the_forward(tmp_path):
    s = analyse(
        edited(
            tmp_path,
            "modeling_gemma.py",
            "        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)",
            "        return super().forward(input_ids)",
        )
    )
    assert s.embed_scale is None  # neither scales: nothing kept
    s = analyse(
        edited(
            tmp_path,
            "modeling_granite.py",
            "inputs_embeds = inputs_embeds * self.embedding_multiplier",
            "inputs_embeds = 2.0 * inputs_embeds",
        )
    )
    assert (s.embed_scale.factor, s.embed_scale.init_lines) == ("2.0", ())


def test_residual_multiplier_reading_more_than_self_refuses_the_fusion(tmp_path):
    s = analyse(
        edited(
            tmp_path,
            "modeling_granite.py",
            "hidden_states = residual + hidden_states * self.residual_multiplier\n"
            "\n        residual",
            "hidden_states = residual + hidden_states * position_ids\n"
            "\n        residual",
        )
    )
    assert s.layer_spec is None
    assert any("reads more than `self`" in r.reason for r in s.refusals)
