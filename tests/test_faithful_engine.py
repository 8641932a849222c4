"""Real vLLM on faithful files: one model of each kind the faithful tier emits, at
TP=1 (all in one process), and each kind at TP=2 or PP=2 (its engine in its own processes).

Kinds: a faithful attention with QKV fused inside it (granite_swa: sinks, windows,
multipliers; vLLM's Transformers backend gives wrong tokens on it), a faithful MoE block
(afmoe: its own sigmoid router and shared experts, no TP plan), a parallel attention +
MLP layer (phi), a GPT-2-style model (gpt2: learned positions, Conv1D, no TP plan: the
plan its dataflow gives), and
a model's own eager attention (bloom: ALiBi; gpt_neo: windows on every other layer),
and a source whose config-wide switch needs two tiny configs (cohere2_moe: an RMSNorm or a
LayerNorm by `rms_norm_eps`, dense layers among its MoE layers).
"""

from __future__ import annotations

import json

import pytest

from conftest import run_cli, verify_in_one_process

pytestmark = pytest.mark.engine

KINDS = ["granite_swa", "afmoe", "phi", "gpt2"]
# granite_swa, afmoe, gpt2, bloom and gpt_neo verify at TP=1 unedited beside their
# able-to-fail copies (test_able_to_fail.py): not run twice
TP1 = ["phi", "opt", "axk1", "cohere2_moe"]


def test_every_kind_verifies_at_tp1():
    results = verify_in_one_process(TP1)
    for model, result in zip(TP1, results):
        assert result["ok"] is True, (model, result)
        assert result["impl"].startswith(f"generated.{model}:"), (model, result)
        assert result["unfused"] > 0  # faithful parts, reported
        assert result["max_abs_logprob_diff"] <= 1e-4 and result["tokens_equal"]
    two = results[TP1.index("cohere2_moe")]
    assert two["tiny_configs"] == 2 and len(two["configs"]) == 2
    assert {"Cohere2MoeRMSNorm", "Cohere2MoeLayerNorm", "Cohere2MoeMLP"} <= set(
        two["kinds"]
    )
    assert two["layer_types"]["mlp_layer_types"] == ["dense", "sparse"]


# One layout per kind here (each run starts two engine processes); the full grid, every
# kind at TP=2 and at PP=2, is `python scripts/parallel_sweep.py`.
@pytest.mark.parametrize(
    "model, parallel",
    [
        ("granite_swa", ["--tp", "2"]),
        ("afmoe", ["--pp", "2"]),
        ("phi", ["--tp", "2"]),
        # no TP plan: sharded as the dataflow says (Conv1D, a packed q|k|v)
        ("gpt2", ["--tp", "2"]),
        # ALiBi slopes per rank; weights read on a branch its config decides
        ("bloom", ["--tp", "2"]),
    ],
    ids=lambda v: v if isinstance(v, str) else "".join(v).replace("--", ""),
)
def test_faithful_kinds_under_parallelism(model, parallel):
    result = run_cli("codemods.verify", model, *parallel, timeout=1200)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and out["ok"], out
    assert out["impl"].startswith(f"generated.{model}:")
    assert (out["tp"], out["pp"]) == ((2, 1) if parallel[0] == "--tp" else (1, 2))
    if parallel[0] == "--tp":
        # what the running engine's largest rank holds of the layers' bytes: shards,
        # not replicas (a model replicated on every rank gives the same tokens)
        assert out["rank_share"] <= 0.6, out


SLOW_BUT_EXACT = ["--override", "pretraining_tp=2", "--override", "slow_but_exact=true"]


def test_a_config_taking_the_weight_reading_branch_is_served_whole():
    """BLOOM's `pretraining_tp > 1 and slow_but_exact` path slices `dense.weight` (and
    drops its bias): a config taking it gets the source's own torch layers and the
    same tokens at TP=1, and a one-line refusal at TP=2, where its linears are sharded.
    """
    result = run_cli("codemods.verify", "bloom", *SLOW_BUT_EXACT, timeout=1200)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and out["ok"], out
    assert out["max_abs_logprob_diff"] <= 1e-4 and out["tokens_equal"]
    result = run_cli(
        "codemods.verify",
        "bloom",
        "--tp",
        "2",
        "--verbose",
        *SLOW_BUT_EXACT,
        timeout=1200,
    )
    assert result.returncode != 0
    assert (
        "ValueError: BloomAttention: this config takes the source's branch "
        "`self.pretraining_tp > 1 and self.slow_but_exact`, which reads weights as "
        "tensors: served at tensor parallel size 1 without quantization only (here: "
        "tensor parallel size 2, quantization None)"
    ) in result.stdout + result.stderr
