"""Every kind of layer the source can build is built, and every length regime reached.

A tiny config built from a config class's defaults builds only what the defaults build
(transformers' `Lfm2Config()`: attention on every layer), and keeps lengths no tiny
prompt reaches (Llama 4's 8192-token chunks). These tests hold the tiny configs to the
source: each class a constructor can build on any branch is built by one of them
(`layer_kinds.cover`), each integer that changes what the model computes without
changing a weight is inside the prompts (`length_regimes`), and what neither can reach
is refused by `apply`, never verified.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, edited_modeling_file, run_cli

GENERATED = sorted(
    p.stem for p in (REPO / "generated").glob("*.py") if not p.name.startswith("_")
)


def _source(name: str):
    from codemods import loading
    from codemods.roles import causal_class
    from codemods.source import load

    src = load(name)
    pymodule = loading.load_module(src, trust_remote_code=True)
    return src, src.classes, causal_class(pymodule, src.classes, src)


def _cover(name: str):
    from codemods import layer_kinds, tiny

    src, classes, causal = _source(name)
    return layer_kinds.cover(causal, src.module, classes, tiny.working_values(causal))


def test_lfm2_builds_its_short_convolution_beside_attention():
    found = _cover("modeling_lfm2.py")
    types = found.primary["layer_types"]
    assert {"conv", "full_attention"} <= set(types)  # a layer on each side
    assert {"Lfm2ShortConv", "Lfm2Attention"} <= found.built[0]


def test_a_stateful_mixer_no_pattern_maps_and_vllm_lacks_is_out_of_scope():
    result = run_cli("codemods.apply", "modeling_zamba.py", "--check")
    assert result.returncode == 2
    assert result.stderr.startswith(
        "error: out of scope: ZambaMambaMixer keeps state across decode steps"
    )
    assert "nn.Conv1d" in result.stderr
    assert "vLLM has no class for ZambaForCausalLM either" in result.stderr
    # what is mapped, from the registry
    assert "(mapped: Mamba-2 mixer, Mamba-1 mixer, gated short convolution, " in (
        result.stderr
    )


def test_a_stateful_mixer_vllm_serves_is_refused_naming_vllms_layers():
    """Kimi Linear: vLLM has a class and state layers for it, so the toolkit could map
    it and does not yet: refused ("cannot generate"), not out of scope."""
    result = run_cli("codemods.apply", "modeling_kimi_linear.py", "--check")
    assert result.returncode == 2
    line = result.stderr.strip()
    assert line.startswith(
        "error: cannot generate: KimiLinearDeltaAttention keeps state across decode "
        "steps"
    )
    assert "vLLM serves KimiLinearForCausalLM with its own " in line
    assert "KimiGatedDeltaNetAttention" in line


@pytest.mark.parametrize(
    "name, kinds",
    [
        ("modeling_mellum.py", {"MellumMLP", "MellumSparseMoeBlock"}),
        ("modeling_granitemoeshared.py", {"GraniteMoeSharedMLP"}),
        ("modeling_granitemoe_swa.py", {"GraniteMoeSWAMLP"}),
    ],
)
def test_one_config_builds_every_layer_kind(name, kinds):
    found = _cover(name)
    assert len(found.variants) == 1 and not found.unbuilt
    assert kinds <= found.built[0]


def test_a_config_wide_switch_gets_a_second_config():
    # Cohere2-MoE builds an RMSNorm or a LayerNorm by `rms_norm_eps`: never both in one
    # model, so verify runs two checkpoints; a dense layer joins the MoE layers
    found = _cover("modeling_cohere2_moe.py")
    assert len(found.variants) == 2
    assert "Cohere2MoeMLP" in found.built[0]
    assert {"Cohere2MoeRMSNorm", "Cohere2MoeLayerNorm"} <= found.all_built()
    assert not {"Cohere2MoeRMSNorm", "Cohere2MoeLayerNorm"} <= found.built[0]


def test_a_kind_no_config_builds_is_refused(monkeypatch):
    # able to fail: without the search for branch values, Mellum's dense layers are
    # never built, and apply must refuse rather than verify the MoE layers alone
    from codemods import layer_kinds
    from codemods.apply import generate
    from codemods.errors import CodemodError

    monkeypatch.setattr(layer_kinds._Candidates, "for_kind", lambda *a: iter(()))
    with pytest.raises(CodemodError, match="no tiny config builds MellumMLP"):
        generate("modeling_mellum.py")


def test_a_sparse_indexer_inside_the_attention_is_refused():
    result = run_cli("codemods.apply", "modeling_minimax_m3_vl.py", "--check")
    assert result.returncode == 2
    assert (
        "MiniMaxM3VLIndexer, inside the attention, keeps its own state" in result.stderr
    )


def test_every_verified_row_verified_every_kind_its_source_can_build():
    """The coverage table: each verified row (every committed model among them) lists
    the kinds its verify runs built, and they hold every class the source's
    constructors can build on any branch (computed here, from the source)."""
    from codemods import branches, layer_kinds

    table = json.loads((REPO / "benchmarks" / "coverage.json").read_text())
    rows = {r["file"]: r for r in table["rows"]}
    verified = [r for r in rows.values() if r["status"] == "verified"]
    assert len(verified) >= 80
    for model in GENERATED:
        header = (REPO / "generated" / f"{model}.py").read_text()[:600]
        file = next(
            line.split("/")[-1]
            for line in header.splitlines()
            if line.startswith("# source:")
        )
        assert rows[file]["status"] == "verified", (model, rows[file].get("reason"))
    for row in verified:
        src, classes, causal = _source(row["file"])
        built = set(row["verify"]["kinds"])
        kinds = layer_kinds._modules(
            causal, branches.reachable_kinds(classes, causal.__name__, built)
        )
        assert set(kinds) <= built, (row["file"], sorted(set(kinds) - built))


def test_every_committed_model_reaches_its_length_regimes(monkeypatch):
    """No committed model's tiny config leaves an integer that changes what the model
    computes past verify's prompts; and without the shrink rule (able to fail) ModernBERT
    decoder's 64-token window and Llama 4's 8192-token chunks are found."""
    from codemods import length_regimes, tiny, verify
    from codemods.probe import PROBE_TOKENS

    assert length_regimes.SMALL < min(max(verify.PROMPT_LENGTHS), PROBE_TOKENS)
    for model in GENERATED:
        header = verify.read_header(REPO / "generated" / f"{model}.py")
        causal_name = header["architecture"].split("->")[1].strip()
        causal = verify.reference_class(header["source"].strip(), causal_name, False)
        values = tiny.working_values(causal)
        assert length_regimes.remaining(causal, values) == [], model
    monkeypatch.setattr(length_regimes, "shrink", lambda c, v, keep=(): v)
    for name, field in (
        ("modeling_modernbert_decoder.py", "local_attention"),
        ("modeling_llama4.py", "attention_chunk_size"),
    ):
        _, _, causal = _source(name)
        assert field in length_regimes.remaining(causal, tiny.working_values(causal))


def test_a_window_longer_than_the_probe_is_read_from_the_source():
    """ModernBERT decoder hands its attention `sliding_window=self.sliding_window`; with
    a window (64) past the probe's 40 tokens the masks look causal, and the window comes
    from the source's own expression, checked against every layer's mask."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from codemods import tiny
    from codemods import probe
    from codemods.copying import attention

    src, classes, causal = _source("modeling_modernbert_decoder.py")
    values = {
        **tiny.working_values(causal),
        "local_attention": 128,
        "sliding_window": 64,
    }
    config = causal.config_class(**values)
    config._attn_implementation = "eager"
    model = causal(config).eval()
    tiny.randomize(model)
    name = "ModernBertDecoderAttention"
    pymodule = __import__(causal.__module__, fromlist=["x"])
    with set_current_vllm_config(VllmConfig()):
        pr = probe.run(
            pymodule, model, config, {name: classes[name]}, config.vocab_size
        )
        spec = attention.infer(classes[name], pr.calls_of(name), config, pymodule)
    assert spec.window == "self.sliding_window"


def test_mask_kinds():
    import torch

    from codemods.copying.attention import mask_kind

    i = torch.arange(12)[:, None]
    j = torch.arange(12)[None, :]
    causal = j <= i
    assert mask_kind(causal[None, None], 12) == ("causal", None)
    assert mask_kind((causal & (i - j < 3))[None, None], 12) == ("window", 3)
    assert mask_kind((causal & (i // 4 == j // 4))[None, None], 12) == ("chunk", 4)
    assert mask_kind(torch.ones(1, 1, 12, 12, dtype=torch.bool), 12)[0] == "other"


def test_a_base_model_counting_positions_from_the_cache_is_refused(tmp_path):
    """TrOCR's decoder counts its position embedding's offset from the cache and hands
    it down: the assembled base forward still reads the folded 0, so `apply` refuses
    (it used to generate a file whose decode steps restart at position 0) and writes
    nothing."""
    result = run_cli("codemods.apply", "modeling_trocr.py", "--out", str(tmp_path))
    assert result.returncode == 2
    assert (
        "cannot generate: TrOCRDecoder counts positions from the cache's length "
        "(`past_key_values_length = past_key_values.get_seq_length()"
    ) in result.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.engine
def test_chunked_attention_runs_as_vllm_chunked_local_attention(tmp_path):
    """Llama 4 without its position-dependent temperature (the part refused above): its
    chunked layers become vLLM's ChunkedLocalAttention, verified with chunks of 32
    tokens inside the prompts (47 tokens)."""
    source = edited_modeling_file(
        tmp_path,
        "modeling_llama4.py",
        "        if self.attn_temperature_tuning and not self.use_rope:\n",
        "        if False:\n",
    )
    out = tmp_path / "out"
    applied = run_cli(
        "codemods.apply", str(source), "--trust-remote-code", "--out", str(out)
    )
    assert applied.returncode == 0, applied.stderr
    text = (out / "llama4.py").read_text()
    assert "ChunkedLocalAttention(" in text
    result = run_cli(
        "codemods.verify",
        str(out / "llama4.py"),
        "--trust-remote-code",
        "--json",
        timeout=1200,
    )
    verdict = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0 and verdict["ok"], verdict
    assert "attention_chunk_size=32" in verdict["features"]
    # the file just generated (registered under its own name), not vLLM's own class
    assert verdict["impl"].startswith("_verify_llama4_"), verdict
    assert verdict["impl"].endswith(":Llama4ForCausalLM"), verdict
