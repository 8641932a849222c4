"""The libcst patterns on edited copies of real transformers sources: what they match,
what they extract, and what they refuse (with the reason)."""

from __future__ import annotations

from pathlib import Path

from codemods.apply import generate
from codemods.source import transformers_root

SOURCE = next(transformers_root().glob("models/qwen3/modeling_qwen3.py")).read_text()
GLU = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"


def mutant(tmp_path: Path, old: str, new: str) -> str:
    assert old in SOURCE, old
    path = tmp_path / "modeling_qwen3.py"
    path.write_text(SOURCE.replace(old, new))
    return str(path)


def test_glu_either_operand_order_gives_the_same_model(tmp_path):
    swapped = mutant(
        tmp_path,
        GLU,
        "self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))",
    )
    plan, text = generate(swapped, trust_remote_code=True)
    assert plan.packed_modules_mapping()["gate_up_proj"] == ["gate_proj", "up_proj"]
    original = generate("modeling_qwen3.py")[1]
    strip = lambda t: t.split('"""', 2)[
        2
    ]  # noqa: E731  (header and docstring name the source)
    assert strip(text) == strip(original)


def test_glu_shard_order_follows_the_activation(tmp_path):
    """Activation on up: up is shard 0, which vLLM's ...AndMul activates."""
    moved = mutant(
        tmp_path,
        GLU,
        "self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))",
    )
    plan, _ = generate(moved, trust_remote_code=True)
    assert plan.packed_modules_mapping()["up_gate_proj"] == ["up_proj", "gate_proj"]
    assert (".mlp.up_proj.", ".mlp.up_gate_proj.", 0) in plan.stacked_params()
    assert (".mlp.gate_proj.", ".mlp.up_gate_proj.", 1) in plan.stacked_params()


def test_stacked_keys_are_scoped_to_their_module():
    plan, _ = generate("modeling_qwen3.py")
    for key, merged, _ in plan.stacked_params():
        assert key.startswith((".self_attn.", ".mlp.")) and key.endswith(".")
        assert merged.split(".")[1] == key.split(".")[1]


def test_tables_come_from_the_fusion_records():
    plan, text = generate("modeling_qwen3.py")
    for record in plan.records:
        assert record.describe() in text  # the header's report
    for merged, sources in plan.packed_modules_mapping().items():
        assert f"{merged!r}: {sources!r}".replace("'", '"') in text


def test_a_file_outside_transformers_needs_trust_remote_code(tmp_path):
    from conftest import run_cli

    path = mutant(tmp_path, GLU, GLU)  # an unchanged copy: still not the installed file
    out = tmp_path / "out"
    result = run_cli("codemods.apply", path, "--out", str(out))
    assert result.returncode == 2
    assert "--trust-remote-code" in result.stderr.strip().splitlines()[-1]
    assert not out.exists()
