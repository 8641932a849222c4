"""A decoder layer holding two attention sublayers (LongCat-Flash): the config counts
sublayers (`num_hidden_layers` = 2 * `num_layers`), the layer list holds decoder layers,
and each sublayer's vLLM attention gets its own KV cache (`layer_idx * 2 + i`)."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run_cli


def test_each_sublayer_builds_its_own_vllm_attention():
    text = (REPO / "generated" / "longcat_flash.py").read_text()
    assert "layer_idx=layer_idx * 2 + i," in text
    assert 'prefix=f"{prefix}.self_attn.{i}",' in text


@pytest.mark.engine
def test_longcat_flash_matches_transformers_in_vllm():
    """Two attention sublayers and two MLPs per layer, identity experts beside the
    routed ones (TP=2 and PP=2: its coverage row and verify)."""
    result = run_cli("codemods.verify", "longcat_flash")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and out["ok"], out
    assert out["impl"] == "generated.longcat_flash:LongcatFlashForCausalLM"
    assert out["tokens_equal"] and out["max_abs_logprob_diff"] <= 1e-4
