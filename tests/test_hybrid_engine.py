"""Real vLLM on a hybrid decoder: Mamba-2 layers (vLLM's MambaMixer2 and its state
cache) next to attention layers, the generated class asserted, greedy tokens and
logprobs against transformers over prompts longer than one SSD chunk and 8 decode
steps (the states carried from step to step)."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

pytestmark = pytest.mark.engine

IMPL = "generated.granitemoehybrid:GraniteMoeHybridForCausalLM"


def verify_json(*args: str) -> dict:
    result = run_cli("codemods.verify", *args)
    lines = result.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines else {}
    assert result.returncode == 0, (out, result.stderr[-2000:])
    return out


def test_granite_4_hybrid_as_published_without_rope():
    """Granite 4.0-H as published: no rope (`position_embedding_type` None), an SSD
    chunk of 8 tokens against prompts of up to 47."""
    out = verify_json(
        "granitemoehybrid",
        "--override",
        "position_embedding_type=null",
        "--override",
        "mamba_chunk_size=8",
    )
    assert out["ok"] and out["impl"] == IMPL, out
    assert out["tokens_equal"] and out["max_abs_logprob_diff"] <= 1e-4
    assert {"GraniteMoeHybridMambaLayer", "GraniteMoeHybridAttention"} <= set(
        out["kinds"]
    )
    assert "mixed_layer_types" in out["features"]


def test_granite_4_hybrid_over_two_ranks():
    """One group over two ranks: each rank's heads read the group, replicated; the
    in-projection bias is loaded the same way (vLLM's own file cannot load it)."""
    out = verify_json("granitemoehybrid", "--tp", "2")
    assert out["ok"] and out["impl"] == IMPL and out["tp"] == 2, out
    assert "mamba_proj_bias" in out["features"]
    assert out["rank_share"] <= 0.7, out


def test_granite_4_hybrid_over_two_pipeline_stages():
    """The state cache and the KV cache of each stage's own layers (a Mamba-2 layer and
    an attention layer on each)."""
    out = verify_json("granitemoehybrid", "--pp", "2")
    assert out["ok"] and out["impl"] == IMPL and out["pp"] == 2, out


def test_mamba_2_without_attention():
    """No attention at all: vLLM's attention-free frame, the state cache alone."""
    out = verify_json("mamba2")
    assert out["ok"] and out["impl"] == "generated.mamba2:Mamba2ForCausalLM", out
    assert out["tokens_equal"] and out["max_abs_logprob_diff"] <= 1e-4


def test_a_time_step_floor_the_time_steps_reach():
    """A floor on the time step high enough that half the time steps hit it: vLLM's
    own mixer would ignore it (without the clamp: |dlogprob| 0.7 on this checkpoint)."""
    out = verify_json(
        "granitemoehybrid",
        "--override",
        "time_step_limit=[0.6, Infinity]",
        "--override",
        "mamba_chunk_size=8",
    )
    assert out["ok"] and out["impl"] == IMPL, out
    assert out["tokens_equal"] and out["max_abs_logprob_diff"] <= 1e-4


def test_falcon_h1_over_two_ranks():
    """Falcon-H1: the in-projection's per-part scales folded into its weight before it
    is sharded, attention and the mixer side by side in each layer."""
    out = verify_json("falcon_h1", "--tp", "2")
    assert out["ok"] and out["impl"] == "generated.falcon_h1:FalconH1ForCausalLM", out
    assert out["tp"] == 2 and out["tokens_equal"], out
    assert "ssm_multipliers=[0.6, 0.75, 0.9, 1.05, 1.2]" in out["features"]
    assert "mamba_rms_norm" in out["features"]


def test_nemotron_h_every_block_kind_over_two_pipeline_stages():
    """Nemotron-H's four block kinds (Mamba-2, attention, MLP, MoE), each stage holding
    a Mamba-2 and an attention block (vLLM 0.32 cannot start a stage with state pages
    only beside one with KV pages only)."""
    out = verify_json(
        "nemotron_h",
        "--pp",
        "2",
        "--override",
        "num_hidden_layers=6",
        "--override",
        'layers_block_type=["linear_attention", "full_attention", "mlp", '
        '"linear_attention", "full_attention", "moe"]',
    )
    assert out["ok"] and out["impl"] == "generated.nemotron_h:NemotronHForCausalLM"
    assert out["pp"] == 2 and out["tokens_equal"], out
    assert {
        "NemotronHMamba2Mixer",
        "NemotronHAttention",
        "NemotronHMLP",
        "NemotronHMoE",
    } <= set(out["kinds"])


def test_zamba_2_shared_blocks_over_two_pipeline_stages():
    """Zamba 2: its layers built by its own method, one shared attention block tied
    over two hybrid layers (one on each stage: each its own KV cache, the tensors saved
    once), the word embeddings every hybrid layer reads sent from the first stage."""
    out = verify_json("zamba2", "--pp", "2")
    assert out["ok"] and out["impl"] == "generated.zamba2:Zamba2ForCausalLM", out
    assert out["pp"] == 2 and out["tokens_equal"], out
    assert "use_shared_attention_adapter" in out["features"]
    assert {"Zamba2HybridLayer", "Zamba2MambaDecoderLayer"} <= set(out["kinds"])
    # an ill-conditioned tiny model: vLLM within twice transformers' own fp32 distance
    # from its float64 run (the bf16 floor's factor: kernels round in other places)
    exact = out.get("exact")
    if exact:
        assert exact["to_exact"] <= max(1e-4, 2 * exact["reference_error"]), out


def test_a_per_layer_theta_with_nope_layers():
    """Granite SWA: each layer's theta, 0 for no rope at all."""
    out = verify_json(
        "granite_swa", "--override", "layer_rope_theta=[10000.0, 0.0, 500.0, 10000.0]"
    )
    assert out["ok"] and out["impl"] == "generated.granite_swa:GraniteSWAForCausalLM"
