"""`python -m codemods.check`: current, hand edits, drift, bad input."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO, run_cli

from codemods.manifest import render
from codemods.source import transformers_root

GENERATED = REPO / "generated"
SOURCE = next(transformers_root().glob("models/qwen3/modeling_qwen3.py"))


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


# A native file and two faithful ones: the cold full run is the first test's alone.
SAMPLE = ("qwen3", "llama", "gpt2")


def copy_generated(tmp_path):
    out = tmp_path / "generated"
    out.mkdir()
    for name in SAMPLE:
        shutil.copy(GENERATED / f"{name}.py", out / f"{name}.py")
    manifest = json.loads((GENERATED / "manifest.json").read_text())
    (out / "manifest.json").write_text(
        render({name: manifest[name] for name in SAMPLE})
    )
    return out


MODELS = len([p for p in GENERATED.glob("*.py") if not p.name.startswith("_")])


def test_main_is_current_and_the_second_run_is_cached(tmp_path, monkeypatch):
    # cold: every file regenerated (109 files: about 14 minutes on 2 busy cores)
    first = run_cli("codemods.check", "-j", "2", timeout=1800)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stderr.strip().splitlines()[-1] == f"All done! {MODELS} files current."
    assert "\r" not in first.stderr  # no progress line outside a terminal
    cached = json.loads(
        (tmp_path / "cache" / "vllm-fusion-codemods" / "check.json").read_text()
    )
    assert len(cached) == MODELS  # one entry per file the cold run found current
    # the second run regenerates nothing: a regeneration would fail it here
    from codemods import check

    def regenerate(*args):
        raise AssertionError(f"regenerated {args[0]} though the cache holds it")

    monkeypatch.setattr(check, "regenerate", regenerate)
    assert check.check(GENERATED, False, 1, False, False, True) == 0


def test_a_hand_edit_fails_with_a_diff_and_fix_restores_it(tmp_path):
    out = copy_generated(tmp_path)
    edited = out / "qwen3.py"
    original = edited.read_text()
    assert original.count("        return hidden_states, residual\n") == 1
    edited.write_text(
        original.replace(
            "return hidden_states, residual\n", "return hidden_states * 1.0, residual\n"
        )
    )
    result = run_cli("codemods.check", "--generated", str(out))
    assert result.returncode == 1
    assert (
        f"would regenerate {edited} (edited by hand or stale); regenerate with: python -m codemods.apply modeling_qwen3.py"
        in result.stderr
    )
    assert (
        "-        return hidden_states * 1.0, residual" in result.stdout
        and "+        return hidden_states, residual" in result.stdout
    )
    assert (
        result.stderr.strip().splitlines()[-1]
        == f"Oh no! 1 file would be regenerated, {len(SAMPLE) - 1} files current."
    )
    fixed = run_cli("codemods.check", "--generated", str(out), "--fix")
    assert fixed.returncode == 0
    assert edited.read_bytes() == (GENERATED / "qwen3.py").read_bytes()


def test_drift_a_renamed_projection_is_reported_by_name(tmp_path):
    src = tmp_path / "fork" / "modeling_qwen3.py"
    src.parent.mkdir()
    shutil.copy(SOURCE, src)
    out = tmp_path / "generated"
    made = run_cli("codemods.apply", str(src), "--out", str(out), "--trust-remote-code")
    assert made.returncode == 0, made.stderr[-2000:]
    assert (
        run_cli(
            "codemods.check", "--generated", str(out), "--trust-remote-code"
        ).returncode
        == 0
    )
    # an upgrade renames a projection
    src.write_text(src.read_text().replace("q_proj", "query_proj"))
    result = run_cli("codemods.check", "--generated", str(out), "--trust-remote-code")
    assert result.returncode == 1
    assert (
        "qwen3: lost fusions recorded in manifest.json: Qwen3Attention: q_proj + k_proj + v_proj -> qkv_proj (QKVParallelLinear)"
        in result.stderr
    )


def test_bad_input_gives_a_message_and_an_exit_code_never_a_traceback(tmp_path):
    out = copy_generated(tmp_path)
    (out / "qwen3.py").write_text(
        "# damaged\n" + (out / "qwen3.py").read_text().split("\n", 12)[-1]
    )
    damaged = run_cli("codemods.check", "--generated", str(out))
    assert (
        damaged.returncode == 1 and "its generated header is damaged" in damaged.stderr
    )

    (out / "qwen3.py").unlink()
    missing = run_cli("codemods.check", "--generated", str(out))
    assert (
        missing.returncode == 1
        and "(missing); regenerate with: python -m codemods.apply modeling_qwen3.py"
        in missing.stderr
    )

    manifest = json.loads((out / "manifest.json").read_text())
    manifest["gone"] = {
        "source": "transformers/models/gone/modeling_gone.py",
        "fusions": {},
        "refusals": [],
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    gone = run_cli("codemods.check", "--generated", str(out))
    assert gone.returncode == 2
    assert (
        "error: gone: its source transformers/models/gone/modeling_gone.py no longer exists"
        in gone.stderr
    )

    (out / "manifest.json").write_text("{not json")
    broken = run_cli("codemods.check", "--generated", str(out))
    assert broken.returncode == 2 and "unreadable manifest" in broken.stderr
    for result in (damaged, missing, gone, broken):
        assert "Traceback" not in result.stderr
