"""The libcst patterns on edited copies of real transformers sources: what they match,
what they extract, and what they refuse (with the reason)."""

from __future__ import annotations

from pathlib import Path

import pytest

from codemods.apply import generate
from codemods.errors import CodemodError
from codemods.source import transformers_root

SOURCE = next(transformers_root().glob("models/qwen3/modeling_qwen3.py")).read_text()
GLU = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"


def mutant(tmp_path: Path, old: str, new: str) -> str:
    assert old in SOURCE, old
    path = tmp_path / "modeling_qwen3.py"
    path.write_text(SOURCE.replace(old, new))
    return str(path)


def test_glu_either_operand_order_gives_the_same_model(tmp_path):
    swapped = mutant(tmp_path, GLU, "self.down_proj(self.up_proj(x) * self.act_fn(self.gate_proj(x)))")
    plan, text = generate(swapped)
    assert plan.packed_modules_mapping()["gate_up_proj"] == ["gate_proj", "up_proj"]
    original = generate("modeling_qwen3.py")[1]
    strip = lambda t: t.split('"""', 2)[2]  # noqa: E731  (header and docstring name the source)
    assert strip(text) == strip(original)


def test_glu_shard_order_follows_the_activation(tmp_path):
    """Activation on up: up is shard 0, which vLLM's ...AndMul activates."""
    moved = mutant(tmp_path, GLU, "self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))")
    plan, _ = generate(moved)
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


@pytest.mark.parametrize(
    "old,new,reason",
    [
        (GLU, "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x + 1))", "gate and up read different tensors"),
        (
            "key_states = self.k_norm(self.k_proj(hidden_states)",
            "key_states = self.k_norm(self.k_proj(hidden_states * 2)",
            "self.k_proj is not applied to a plain name",
        ),
        (
            "value_states = self.v_proj(hidden_states).view(hidden_shape)",
            "value_states = torch.tanh(self.v_proj(hidden_states)).view(hidden_shape)",
            "between a projection and attention",
        ),
        (
            "self.v_proj = nn.Linear(\n            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias",
            "self.v_proj = nn.Linear(\n            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True",
            "bias differs between the projections",
        ),
        (
            "hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
            "hidden_states * torch.rsqrt(variance) + self.variance_epsilon",
            "eps is not added inside the root",
        ),
        (
            "query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))",
            "query_states = self.q_norm(self.q_proj(hidden_states)).view(hidden_shape)",
            "norm over the whole projection",
        ),
        (
            "        hidden_states = residual + hidden_states\n\n        # Fully Connected",
            "        hidden_states = residual - hidden_states\n\n        # Fully Connected",
            "is not the plain residual add",
        ),
    ],
    ids=["glu-inputs", "k-input", "v-extra-op", "v-bias", "eps-outside-root", "q-norm-whole", "residual-sub"],
)
def test_unprovable_candidates_are_refused_loudly(tmp_path, old, new, reason):
    with pytest.raises(CodemodError) as info:
        generate(mutant(tmp_path, old, new))
    assert reason in str(info.value)
    assert "\n" not in str(info.value)
