"""The rope pattern on a copied attention (`fusion_patterns/rotary.py`), on edited copies
of a real transformers source whose attention is not vLLM's own layout (SmolLM3: some
layers skip rope). Engine-free: what is claimed, what the file holds, what is refused;
`verify` runs the claimed files in vLLM (the coverage run, the able-to-fail copies)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from codemods.apply import generate
from codemods.source import transformers_root

SOURCE = next(
    transformers_root().glob("models/smollm3/modeling_smollm3.py")
).read_text()
ATTENTION = "SmolLM3Attention"


def mutant(tmp_path: Path, *edits: tuple[str, str]) -> str:
    text = SOURCE
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "modeling_smollm3.py"
    path.write_text(text)
    return str(path)


def rope_records(plan):
    return [r for r in plan.records if r.pattern == "rope"]


def test_a_copied_attention_takes_vllm_rope_on_vllm_positions():
    plan, text = generate("modeling_smollm3.py")
    assert any(
        r.source_class == ATTENTION and r.pattern != "rope" for r in plan.refusals
    ), "the attention is not claimed whole (it is a copy)"
    [record] = rope_records(plan)
    assert (record.source_class, record.vllm_class) == (ATTENTION, "get_rope")
    assert "NeoX" in record.describe()
    ast.parse(text)
    assert "is_neox_style=True" in text
    assert re.search(
        r"self\._vllm_rope\(\s*positions,\s*query_states,\s*key_states\s*\)", text
    )
    # the source's rotary module and tables are gone: nothing reads them any more
    assert "class SmolLM3RotaryEmbedding" not in text
    assert "apply_rotary_pos_emb(" not in text
    assert "position_embeddings = self.rotary_emb(" not in text


def test_the_pair_style_is_read_from_the_numbers(tmp_path):
    """The same source with GPT-J pairs (interleaved) instead of NeoX halves: vLLM's
    rope with is_neox_style=False, found by the proof, not by a name."""
    edited = mutant(
        tmp_path,
        (
            "emb = torch.cat((freqs, freqs), dim=-1)",
            "emb = torch.repeat_interleave(freqs, 2, dim=-1)",
        ),
        (
            "x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n"
            "    return torch.cat((-x2, x1), dim=-1)",
            "x1 = x[..., ::2]\n    x2 = x[..., 1::2]\n"
            "    return torch.stack((-x2, x1), dim=-1).flatten(-2)",
        ),
    )
    plan, text = generate(edited, trust_remote_code=True)
    [record] = rope_records(plan)
    assert "GPT-J" in record.describe()
    assert "is_neox_style=False" in text


def test_a_rope_theta_not_read_from_the_config_is_refused(tmp_path):
    """A rotary module with its theta written in (here the tiny config's own value, so
    the numbers agree on the tiny model): a checkpoint with another theta would get
    vLLM's rope from its config and the source's from the constant. Refused."""
    edited = mutant(
        tmp_path,
        ('base = config.rope_parameters["rope_theta"]', "base = 2000000.0"),
    )
    plan, text = generate(edited, trust_remote_code=True)
    assert rope_records(plan) == []
    [refusal] = [r for r in plan.refusals if r.pattern == "rope"]
    assert "does not read its theta" in refusal.describe()
    assert "class SmolLM3RotaryEmbedding" in text
    assert "get_rope(" not in text


def test_a_rotated_tensor_read_after_the_call_is_refused(tmp_path):
    """vLLM's rope rotates in place: a source that reads the unrotated query again
    keeps its own rotary code."""
    edited = mutant(
        tmp_path,
        (
            "query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)",
            "rotated_q, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)\n"
            "            query_states = rotated_q + 0 * query_states",
        ),
    )
    plan, _ = generate(edited, trust_remote_code=True)
    assert rope_records(plan) == []
    [refusal] = [r for r in plan.refusals if r.pattern == "rope"]
    assert "is read after the rotary call" in refusal.describe()


def test_an_attention_that_computes_attention_itself_keeps_its_rope():
    """Falcon's attention computes attention in its own code, which the copy replaces by
    vLLM's attention statement by statement; rope is not rewritten inside such a class
    (rewritten first, the core was not found and the eager math ran under vLLM)."""
    plan, text = generate("modeling_falcon.py")
    assert rope_records(plan) == []
    [refusal] = [r for r in plan.refusals if r.pattern == "rope"]
    assert "computes attention itself" in refusal.describe()
    assert "_vllm_rope" not in text
    assert "vllm_attention_heads(" in text


def test_a_rope_applied_only_when_tables_are_handed_is_kept_as_the_source_has_it():
    """Granite's SWA attention rotates only `if position_embeddings is not None`: its
    base model hands no tables to a layer whose theta is 0 (NoPE), and a different
    table per theta. vLLM's rope built once in `__init__` would rotate every layer at
    the global theta (the generated file did, and verified only because the tiny config
    gave every layer the same theta)."""
    plan, text = generate("modeling_granite_swa.py")
    assert rope_records(plan) == []
    [refusal] = [r for r in plan.refusals if r.pattern == "rope"]
    assert "applied only `if position_embeddings is not None`" in refusal.describe()
    assert "if position_embeddings is not None:" in text
    assert "get_rope(" not in text
