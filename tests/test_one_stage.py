"""A model whose base model cannot be split over pipeline stages is served on one
stage, said in its report, not refused whole: Gemma 3n's `__init__` reads every
layer's attention (its kv-shared layers), which a pipeline stage holds only for its own
layers (Gemma 4 too). The class does not declare SupportsPP (vLLM refuses PP for it) and
`verify --pp` refuses in one line with the report's reason."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run_cli


def test_gemma3n_is_generated_for_one_pipeline_stage():
    from codemods.apply import generate

    plan, text = generate("modeling_gemma3n.py")
    said = [line for line in plan.report() if "pipeline parallel" in line]
    assert said == [
        "Unfused: pipeline parallel (Gemma3nTextModel): not supported: "
        "Gemma3nTextModel.__init__ reads every layer's `layer.self_attn`, and a "
        "pipeline stage holds only its own layers"
    ], said
    assert "class Gemma3nForCausalLM(nn.Module, SupportsLoRA, SupportsQuant):" in text
    # every other committed file splits over stages but Gemma 4 (the same loop)
    one_stage = {
        path.stem
        for path in (REPO / "generated").glob("*.py")
        if "Unfused: pipeline parallel" in path.read_text()[:8192]
    }
    assert one_stage == {"gemma3n", "gemma4"}


def test_verify_refuses_pipeline_stages_with_the_reports_reason():
    result = run_cli("codemods.verify", "gemma3n", "--pp", "2")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (
        "error: gemma3n: pipeline parallel is not supported by this file: "
        "Gemma3nTextModel.__init__ reads every layer's `layer.self_attn`, and a "
        "pipeline stage holds only its own layers"
    ), lines
    assert json.loads(result.stdout.strip().splitlines()[-1])["ok"] is False


@pytest.mark.engine
def test_gemma3n_matches_transformers_in_vllm():
    """Altup, laurel, per-layer inputs, kv-shared layers (TP=2: its coverage row)."""
    result = run_cli("codemods.verify", "gemma3n")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and out["ok"], out
    assert out["impl"] == "generated.gemma3n:Gemma3nForCausalLM"
    assert out["tokens_equal"] and out["max_abs_logprob_diff"] <= 1e-4
