"""The fusion manifest: committed, current, and guarding against lost fusions."""

from __future__ import annotations

import json
import shutil

from conftest import REPO, run_cli

from codemods.source import transformers_root

GENERATED = REPO / "generated"
SOURCE = next(transformers_root().glob("models/qwen3/modeling_qwen3.py")).read_text()


def test_manifest_records_the_qwen3_fusions_and_source_hash():
    import hashlib

    entry = json.loads((GENERATED / "manifest.json").read_text())["qwen3"]
    source = next(transformers_root().glob("models/qwen3/modeling_qwen3.py"))
    assert entry["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    assert (
        entry["fusions"]["Qwen3Attention"][
            "q_proj + k_proj + v_proj -> qkv_proj (QKVParallelLinear)"
        ]
        == 1
    )
    assert (
        entry["fusions"]["Qwen3DecoderLayer"][
            "input_layernorm -> input_layernorm (RMSNorm)"
        ]
        == 1
    )
    assert entry["refusals"] == []


def test_a_regeneration_that_loses_a_fusion_fails_unless_accepted(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("qwen3.py", "manifest.json"):
        shutil.copy(GENERATED / name, out / name)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    glu = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
    edited = tmp_path / "src" / "modeling_qwen3.py"
    edited.parent.mkdir()
    # up reads another tensor than gate: neither the gated MLP nor a merged GEMM
    edited.write_text(SOURCE.replace(glu, glu.replace("up_proj(x)", "up_proj(x + 1)")))

    lost = run_cli(
        "codemods.apply", str(edited), "--out", str(out), "--trust-remote-code"
    )
    assert lost.returncode == 1
    assert (
        "loses fusions recorded in manifest.json: Qwen3MLP: gate_proj + up_proj -> gate_up_proj"
        in lost.stderr
    )
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    accepted = run_cli(
        "codemods.apply",
        str(edited),
        "--out",
        str(out),
        "--trust-remote-code",
        "--accept-lost-fusions",
    )
    assert accepted.returncode == 0, accepted.stderr[-2000:]
    entry = json.loads((out / "manifest.json").read_text())["qwen3"]
    # the copied MLP keeps only its activation, built by name through vLLM's ops
    assert list(entry["fusions"].get("Qwen3MLP", {})) == [
        "ACT2FN[config.hidden_act] -> act_fn (act_fn(config.hidden_act))"
    ]
    assert entry["refusals"] == [
        "Refused: gate/up projections (Qwen3MLP): gate and up read different tensors "
        "(`x`, `x + 1`)"
    ]


def test_check_fails_on_a_stale_manifest(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(GENERATED / "qwen3.py", out / "qwen3.py")
    manifest = json.loads((GENERATED / "manifest.json").read_text())
    manifest["qwen3"]["sha256"] = "0" * 64
    (out / "manifest.json").write_text(json.dumps(manifest))
    result = run_cli(
        "codemods.apply", "modeling_qwen3.py", "--out", str(out), "--check"
    )
    assert result.returncode == 1
    assert f"would regenerate {out / 'manifest.json'}" in result.stderr
