"""Positions a module counts from the cache -> vLLM's positions, engine-free: matched on
the source form, claimed where the probe hands the tokens at dim 1, and refused (apply
stops with the reason) where the count is anything else."""

from __future__ import annotations

import libcst as cst

from conftest import edited_modeling_file, run_cli

from codemods.source import class_infos
from fusion_patterns.cache_positions import match

LLAMA4_COUNT = (
    "positions = torch.arange(hidden_states.shape[1], device=hidden_states.device)"
    " + past_seen_tokens"
)


def _specs(body: str):
    module = cst.parse_module(
        "class A:\n"
        "    def forward(self, hidden_states, past_key_values=None):\n"
        "        seen = past_key_values.get_seq_length() if past_key_values else 0\n"
        + "".join(f"        {line}\n" for line in body.splitlines())
        + "        return pos\n"
    )
    return match(class_infos(module)["A"])


def test_the_count_is_matched_in_either_order_and_only_over_the_tokens():
    assert [
        s.target for s in _specs("pos = torch.arange(hidden_states.shape[1]) + seen")
    ] == ["pos"]
    assert [
        s.length for s in _specs("pos = seen + torch.arange(hidden_states.shape[1])")
    ] == ["seen"]
    # the batch dim, another offset, a name not from the cache: not vLLM's positions
    assert _specs("pos = torch.arange(hidden_states.shape[0]) + seen") == []
    assert _specs("pos = torch.arange(hidden_states.shape[1]) + seen + 1") == []
    assert _specs("pos = torch.arange(hidden_states.shape[1]) + 3") == []


def test_llama4_attention_temperature_reads_vllms_positions():
    """Llama 4 counts its no-rope layers' temperature positions from the cache: the copy
    reads vLLM's positions instead, handed down by the decoder layer (the model used to
    be refused, its positions restarting at 0 on every decode step)."""
    from codemods.apply import generate

    plan, text = generate("modeling_llama4.py")
    assert any(
        line.startswith(
            "Fused: positions (Llama4TextAttention) -> positions (vLLM's positions"
        )
        for line in plan.report()
    )
    code_lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert not [line for line in code_lines if "+ past_seen_tokens" in line]
    assert "torch.floor((positions.float() + 1.0) / self.floor_scale)" in text
    assert "positions=positions," in text
    # its experts stay the source's bmm over every expert: held whole under TP, and said
    assert any(
        line.startswith(
            "Unfused: tensor parallel (Llama4TextExperts): replicated on every rank: "
            "gate_up_proj, down_proj"
        )
        for line in plan.report()
    )


def test_a_count_off_by_one_is_not_vllms_positions_and_is_refused(tmp_path):
    path = edited_modeling_file(
        tmp_path, "modeling_llama4.py", LLAMA4_COUNT, LLAMA4_COUNT + " + 1"
    )
    result = run_cli(
        "codemods.apply", str(path), "--trust-remote-code", "--out", str(tmp_path / "o")
    )
    assert result.returncode == 2
    assert (
        "Llama4TextAttention counts positions from the cache's length" in result.stderr
    )
