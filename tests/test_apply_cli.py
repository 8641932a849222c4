"""`python -m codemods.apply`: outputs, black-style modes, determinism, bad input."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import REPO, run_cli

from codemods.apply import generate
from codemods.source import transformers_root

QWEN3 = "modeling_qwen3.py"
COMMITTED = REPO / "generated" / "qwen3.py"


def test_committed_qwen3_is_current():
    result = run_cli("codemods.apply", QWEN3, "--check")
    assert result.returncode == 0, result.stderr


def test_out_writes_named_after_model_type_and_reports_fusions(tmp_path):
    result = run_cli("codemods.apply", QWEN3, "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "qwen3.py"]
    assert (tmp_path / "qwen3.py").read_bytes() == COMMITTED.read_bytes()
    report = result.stderr.splitlines()
    assert (
        "Fused: q_proj + k_proj + v_proj (Qwen3Attention) -> qkv_proj (QKVParallelLinear)"
        in report
    )
    assert (
        "Fused: gate_proj + up_proj (Qwen3MLP) -> gate_up_proj (MergedColumnParallelLinear)"
        in report
    )
    assert any(
        line.startswith("Fused: residual add + post_attention_layernorm")
        for line in report
    )


def test_a_path_works_like_the_bare_name(tmp_path):
    path = next(transformers_root().glob(f"models/qwen3/{QWEN3}"))
    assert run_cli("codemods.apply", str(path), "--out", str(tmp_path)).returncode == 0
    assert (tmp_path / "qwen3.py").read_bytes() == COMMITTED.read_bytes()


def test_generation_is_deterministic():
    first, second = generate(QWEN3)[1], generate(QWEN3)[1]
    assert first == second


def test_header_names_source_hash_versions_and_command():
    import hashlib

    import transformers

    head = COMMITTED.read_text().split('"""', 1)[0]
    source = next(transformers_root().glob(f"models/qwen3/{QWEN3}"))
    assert "@generated" in head and "DO NOT EDIT" in head
    assert "transformers/models/qwen3/modeling_qwen3.py" in head
    assert hashlib.sha256(source.read_bytes()).hexdigest() in head
    assert f"transformers {transformers.__version__}" in head
    assert "python -m codemods.apply modeling_qwen3.py" in head


def test_output_is_black_formatted():
    import black

    text = COMMITTED.read_text()
    assert black.format_str(text, mode=black.Mode()) == text


def test_check_and_diff_on_a_stale_file_write_nothing(tmp_path):
    stale = tmp_path / "qwen3.py"
    shutil.copy(COMMITTED, stale)
    stale.write_text(stale.read_text().replace("self.o_proj", "self.out_proj", 1))
    before = stale.read_bytes()

    check = run_cli("codemods.apply", QWEN3, "--out", str(tmp_path), "--check")
    assert check.returncode == 1
    assert f"would regenerate {stale}" in check.stderr
    diff = run_cli("codemods.apply", QWEN3, "--out", str(tmp_path), "--diff")
    assert diff.returncode == 0
    assert (
        "-        self.out_proj" in diff.stdout
        and "+        self.o_proj" in diff.stdout
    )
    assert stale.read_bytes() == before


def test_check_on_a_missing_file_exits_1(tmp_path):
    assert (
        run_cli("codemods.apply", QWEN3, "--out", str(tmp_path), "--check").returncode
        == 1
    )
    assert not any(tmp_path.iterdir())


def _bad_inputs(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "modeling_broken.py").write_text("class Broken(nn.Module:\n    pass\n")
    (tmp_path / "modeling_notes.txt").write_text("not python\n")
    (tmp_path / "modeling_empty.py").write_text("import torch\n\nX = 1\n")
    return {
        "missing file": str(tmp_path / "modeling_missing.py"),
        "syntax error": str(tmp_path / "modeling_broken.py"),
        "not python": str(tmp_path / "modeling_notes.txt"),
        "no model": str(tmp_path / "modeling_empty.py"),
        "unknown name": "modeling_no_such_model_type.py",
    }


@pytest.mark.parametrize(
    "case", ["missing file", "syntax error", "not python", "no model", "unknown name"]
)
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, case):
    out = tmp_path / "out"
    out.mkdir()
    target = _bad_inputs(tmp_path)[case]
    result = run_cli("codemods.apply", target, "--out", str(out))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert not any(out.iterdir())


def test_a_source_that_fails_to_build_is_one_line_exit_2(tmp_path):
    source = (transformers_root() / "models/qwen3/modeling_qwen3.py").read_text()
    anchor = "        self.model = Qwen3Model(config)\n"
    assert source.count(anchor) == 1
    path = tmp_path / "modeling_qwen3.py"
    path.write_text(
        source.replace(anchor, anchor + '        raise ValueError("boom")\n')
    )
    out = tmp_path / "out"
    result = run_cli(
        "codemods.apply", str(path), "--out", str(out), "--trust-remote-code"
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (
        "error: cannot build a tiny Qwen3ForCausalLM from the source: ValueError: boom"
    ), result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()
