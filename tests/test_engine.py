"""Real vLLM: the generated class runs, and matches transformers token for token.

Each engine runs in a subprocess of its own (as users run it), so the plugin
registration is exercised exactly as in production and the class that ran is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO, run_cli

pytestmark = pytest.mark.engine


def verify_json(*args: str) -> tuple[int, dict]:
    result = run_cli("codemods.verify", *args)
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "{}"
    return result.returncode, json.loads(last)


# TP=1: qwen3 verifies unedited beside its able-to-fail copies (test_able_to_fail.py)
@pytest.mark.parametrize("parallel", [["--tp", "2"], ["--pp", "2"]], ids=["tp2", "pp2"])
def test_verify_qwen3(parallel):
    rc, out = verify_json("qwen3", *parallel)
    assert rc == 0, out
    assert out["ok"] is True
    assert out["impl"] == "generated.qwen3:Qwen3ForCausalLM"
    assert out["tokens_equal"] is True and out["max_abs_logprob_diff"] <= 1e-4
    assert (out["tp"], out["pp"]) == ((2, 1) if "--tp" in parallel else (1, 2))
    if "--tp" in parallel:
        assert out["rank_share"] <= 0.6, out  # each rank holds its shards, measured
    assert (
        "mixed_layer_types" in out["features"] and "attention_bias" in out["features"]
    )


def test_kv_heads_replicated_when_fewer_than_ranks():
    rc, out = verify_json("qwen3", "--tp", "2", "--override", "num_key_value_heads=1")
    assert rc == 0 and out["ok"], out
    assert out["tp"] == 2 and out["impl"] == "generated.qwen3:Qwen3ForCausalLM"


def test_a_window_the_source_ignores_is_not_applied():
    """llama's source never slides; with `sliding_window` in its config, vLLM's Attention
    would fall back to that model-level window unless the generated file switches it off.
    """
    rc, out = verify_json("llama", "--override", "sliding_window=8")
    assert rc == 0 and out["ok"], out
    assert out["impl"] == "generated.llama:LlamaForCausalLM", out
    assert out["overrides"] == {"sliding_window": 8}, out  # in the checkpoint's config


def test_verify_a_published_config_with_overrides():
    """Qwen3-8B's published config.json (legacy rope_theta field included), shrunk, with
    yarn rope scaling switched on by --override."""
    rc, out = verify_json(
        "qwen3",
        "--config",
        str(REPO / "tests" / "data" / "qwen3-8b.config.json"),
        "--override",
        'rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}',
        "--override",
        "attention_bias=true",
    )
    assert rc == 0, out
    assert out["ok"] and out["impl"] == "generated.qwen3:Qwen3ForCausalLM"
    assert "rope_type=yarn" in out["features"] and "attention_bias" in out["features"]


def test_bad_override_is_one_line_exit_2():
    result = run_cli("codemods.verify", "qwen3", "--override", "attention_bias=yes")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --override 'attention_bias=yes': the value is not JSON (strings need quotes)"
    ]


def test_full_forward_logits_match_transformers(qwen3_checkpoint, tmp_path):
    """Every vocabulary logit at every prompt position, from one engine forward."""
    ckpt, hf = qwen3_checkpoint
    prompts = [[1, 5, 9, 200, 33, 7, 401, 12, 99, 3, 17, 250], [4, 8, 15, 16, 23, 42]]
    script = textwrap.dedent(f"""
        import json, torch
        from codemods import engine
        impl, logits = engine.prompt_logits({str(ckpt)!r}, "GeneratedQwen3ForCausalLM", {prompts!r})
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
        print(json.dumps({{"impl": impl}}))
        """)
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        json.loads(result.stdout.strip().splitlines()[-1])["impl"]
        == "generated.qwen3:Qwen3ForCausalLM"
    )
    logits = torch.load(tmp_path / "logits.pt")
    with torch.no_grad():
        for prompt, got in zip(prompts, logits):
            want = hf(torch.tensor([prompt])).logits[0, :-1]
            assert got.shape == want.shape
            assert float((got - want).abs().max()) <= 1e-4
