"""The source's arithmetic outside the fusions (embedding and logits scales, soft-caps,
residual multipliers, sandwich norms) stays where the source has it, and packed
projections are read as packed, on the committed files and on edited copies.
Engine-free.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import edited_modeling_file

from codemods.pipeline import generate

GENERATED = Path(__file__).resolve().parents[1] / "generated"


def forward_of(text: str, cls: str) -> str:
    """The text of `cls`'s forward in a generated file."""
    import libcst as cst
    import libcst.matchers as m

    (node,) = [
        c for c in cst.parse_module(text).body if m.matches(c, m.ClassDef(m.Name(cls)))
    ]
    (fwd,) = [
        f for f in node.body.body if m.matches(f, m.FunctionDef(m.Name("forward")))
    ]
    return cst.Module(body=[fwd]).code


def test_granite_multipliers_stay_where_the_source_applies_them():
    """Every multiplier of the source is in the generated forward, in its place: the
    residual multiplier on each sublayer's output before the fused residual add."""
    text = (GENERATED / "granite.py").read_text()
    layer = forward_of(text, "GraniteDecoderLayer")
    assert layer.count("hidden_states = hidden_states * self.residual_multiplier") == 2
    assert layer.index("self.self_attn(") < layer.index("residual_multiplier")
    assert "inputs_embeds = inputs_embeds * self.embedding_multiplier" in text
    assert "logits = logits / self.config.logits_scaling" in text
    assert "self.scaling = config.attention_multiplier" in text


def test_gemma2_sandwich_norms_and_soft_caps():
    text = (GENERATED / "gemma2.py").read_text()
    layer = forward_of(text, "Gemma2DecoderLayer")
    # the post-norms stay on each sublayer's output, the pre-norms take the residual
    flat = "".join(layer.split())
    assert "self.post_attention_layernorm(hidden_states)" in flat
    assert "self.post_feedforward_layernorm(hidden_states)" in flat
    assert "self.pre_feedforward_layernorm(hidden_states,residual)" in flat
    assert "logits = torch.tanh(logits)" in text
    assert "logits_soft_cap=self.attn_logit_softcapping" in text


def test_packed_projections_stack_nothing():
    """Phi-3's checkpoint holds qkv_proj and gate_up_proj already merged; GPT-NeoX's
    holds q/k/v interleaved per head: mapped to themselves, nothing stacked."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        plan, _ = generate("modeling_phi3.py")
    assert plan.packed_modules_mapping() == {
        "qkv_proj": ["qkv_proj"],
        "gate_up_proj": ["gate_up_proj"],
    }
    assert plan.stacked_params() == []
    neox = (GENERATED / "gpt_neox.py").read_text()
    assert 'packed_modules_mapping = {"query_key_value": ["query_key_value"]}' in neox
    assert "packed per head in the checkpoint, reordered at load" in neox


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
    "name, old, new, kept",
    [
        (
            "modeling_gemma2.py",
            "            logits = torch.tanh(logits)\n",
            "            logits = torch.sigmoid(logits)\n",
            "logits = torch.sigmoid(logits)",
        ),
        (
            "modeling_granite.py",
            "inputs_embeds = inputs_embeds * self.embedding_multiplier",
            "inputs_embeds = inputs_embeds / self.embedding_multiplier",
            "inputs_embeds = inputs_embeds / self.embedding_multiplier",
        ),
        (
            "modeling_granite.py",
            "        hidden_states = outputs.last_hidden_state\n",
            "        hidden_states = outputs.last_hidden_state * 0.5\n",
            "hidden_states = hidden_states * 0.5",  # in compute_logits
        ),
    ],
)
def test_arithmetic_no_pattern_knows_is_generated_as_the_source_writes_it(
    tmp_path, name, old, new, kept
):
    """An edit no pattern was written for is neither refused nor dropped: the generated
    file computes it where the source does."""
    from vllm.config import VllmConfig, set_current_vllm_config

    path = edited_modeling_file(tmp_path, name, old, new)
    with set_current_vllm_config(VllmConfig()):
        _, text = generate(str(path), trust_remote_code=True)
    assert kept in text


def test_a_residual_multiplier_reading_the_stream_is_kept(tmp_path):
    """A multiplier no pattern knows (it reads the residual stream) stays in the
    generated layer; the other parts are still fused."""
    from vllm.config import VllmConfig, set_current_vllm_config

    path = edited_modeling_file(
        tmp_path,
        "modeling_granite.py",
        "hidden_states = residual + hidden_states * self.residual_multiplier\n"
        "\n        residual",
        "hidden_states = residual + hidden_states * residual.mean(-1, keepdim=True)\n"
        "\n        residual",
    )
    with set_current_vllm_config(VllmConfig()):
        plan, text = generate(str(path), trust_remote_code=True)
    assert "hidden_states * residual.mean(-1, keepdim=True)" in text
    report = plan.report()
    assert any(line.startswith("Fused: q_proj + k_proj + v_proj") for line in report)
