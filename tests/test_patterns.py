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


# vLLM's own qwen3.py loads q/k/v and gate/up into these shards (its
# stacked_params_mapping), written out here, not read from the code under test
QWEN3_STACKED = {
    (".self_attn.q_proj.", ".self_attn.qkv_proj.", "q"),
    (".self_attn.k_proj.", ".self_attn.qkv_proj.", "k"),
    (".self_attn.v_proj.", ".self_attn.qkv_proj.", "v"),
    (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
    (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
}


def _class_table(text: str, name: str):
    """The literal value of the dict `name` (a class attribute, or a keyword argument)
    in the generated file."""
    import ast

    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"no {name} in the generated file")


def test_stacked_keys_are_scoped_to_their_module():
    plan, text = generate("modeling_qwen3.py")
    assert set(plan.stacked_params()) == QWEN3_STACKED
    # the file's loader table says the same, entry for entry
    table = _class_table(text, "orig_to_new_stacked")
    assert {(k, *v) for k, v in table.items()} == QWEN3_STACKED


def test_tables_come_from_the_fusion_records():
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    plan, text = generate("modeling_qwen3.py")
    # one record per fused part: three norms, two head norms, two merges, two folds
    assert len(plan.records) == 9
    header = text.split('"""', 1)[0]
    for record in plan.records:
        assert f"#   {record.describe()}\n" in header
    mapping = _class_table(text, "packed_modules_mapping")
    assert mapping == plan.packed_modules_mapping()
    # what vLLM's own Qwen3 declares (quantization and LoRA read it)
    assert mapping == Qwen3ForCausalLM.packed_modules_mapping


def test_a_file_outside_transformers_needs_trust_remote_code(tmp_path):
    from conftest import run_cli

    path = mutant(tmp_path, GLU, GLU)  # an unchanged copy: still not the installed file
    out = tmp_path / "out"
    result = run_cli("codemods.apply", path, "--out", str(out))
    assert result.returncode == 2
    assert "--trust-remote-code" in result.stderr.strip().splitlines()[-1]
    assert not out.exists()
