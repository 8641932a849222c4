"""Latent attention's rope (`fusion_patterns/mla`): DeepSeek-V2 rotates pairs as complex
numbers and is served by vLLM's MLA layer (no VLLM_MLA_DISABLE), and a scaled rope
(yarn, what real DeepSeek checkpoints use) is emitted only where the source module,
rebuilt with it, computes MLA with the vLLM rope it maps to. Engine-free; the yarn
checkpoints run in vLLM in test_moe.py."""

from __future__ import annotations

from codemods.apply import generate
from fusion_patterns.mla import proof


def test_deepseek_v2_runs_vllms_latent_attention_with_its_pair_rope():
    plan, text = generate("modeling_deepseek_v2.py")
    assert "VLLM_MLA_DISABLE" not in text
    assert "self.mla_attn = MultiHeadLatentAttentionWrapper(" in text
    # `torch.view_as_complex` over pairs of the last dim: GPT-J style, not halves
    assert "is_neox_style=False," in text
    assert (
        "Fused: kv_a_proj_with_mqa + kv_a_layernorm + kv_b_proj + rope + attention "
        "(DeepseekV2Attention) -> mla_attn"
    ) in "\n".join(plan.report())
    # yarn proven (its two cases) against vLLM's yarn: accepted as it is named
    assert (
        'if rope_type not in (\n            "default",\n            "yarn",\n' in text
    )


def test_a_vllm_rope_computing_something_else_is_not_taken_for_yarn(monkeypatch):
    # vLLM's linear scaling is a rope, and a scaled one, but not yarn: refused, said,
    # and a yarn checkpoint then stops with its name instead of loading wrong
    monkeypatch.setattr(proof, "SCALED_ROPES", {"yarn": ("linear",)})
    plan, text = generate("modeling_deepseek_v2.py")
    refused = [line for line in plan.report() if line.startswith("Refused: yarn rope")]
    assert (
        len(refused) == 1
        and "no vLLM rope computes it in latent attention (linear: " in refused[0]
    ), refused
    assert 'if rope_type not in ("default",):' in text
    assert "self.mla_attn = MultiHeadLatentAttentionWrapper(" in text
