"""The instances a copied class's tensor-parallel proof runs on: one of each structure
and of each set of plain values `__init__` kept, since a forward can branch on them
(Gemma 3n's MLP computes a mean and a deviation over its whole width only where its
layer's activation sparsity is above 0). Engine-free."""

from __future__ import annotations

from types import SimpleNamespace

from transformers.models.gemma3n.configuration_gemma3n import Gemma3nTextConfig
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nTextMLP

from codemods.copying import _instance_kinds


def _model(instances):
    probe = SimpleNamespace(
        instances={"Gemma3nTextMLP": [(f"layers.{i}.mlp", m) for i, m in instances]}
    )
    return SimpleNamespace(probe=probe, call=lambda inst: None)


def test_layers_differing_in_a_kept_value_are_each_a_kind():
    config = Gemma3nTextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        activation_sparsity_pattern=[0.0, 0.0, 0.95, 0.95],
    )
    layers = [(i, Gemma3nTextMLP(config, i)) for i in range(4)]
    kinds = _instance_kinds(_model(layers), "Gemma3nTextMLP")
    # the dense layers first (as the tiny model builds them), then the sparse ones
    assert [k.activation_sparsity for k, _ in kinds] == [0.0, 0.95]


def test_the_position_in_the_stack_alone_makes_no_kind():
    config = Gemma3nTextConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        activation_sparsity_pattern=[0.0] * 4,
    )
    layers = [(i, Gemma3nTextMLP(config, i)) for i in range(4)]
    for i, mlp in layers:
        mlp.layer_idx = i  # as attention and decoder layers keep it
    assert len(_instance_kinds(_model(layers), "Gemma3nTextMLP")) == 1


def test_a_class_sharding_on_some_kinds_only_is_whole_on_the_others():
    # the committed file (codemods.check keeps it current): Gemma 3n's dense MLPs shard,
    # its sparse ones are whole on every rank (`verify gemma3n --tp 2 [--override
    # activation_sparsity_pattern=[0.0,0.95,0.0,0.95]]`: 5.7e-06, 5.2e-06)
    from conftest import REPO

    text = (REPO / "generated" / "gemma3n.py").read_text()
    mlp = text[text.index("class Gemma3nTextMLP") :]
    mlp = mlp[: mlp.index("def forward")]
    pinned = "disable_tp=config.activation_sparsity_pattern[layer_idx] != 0.0,"
    assert mlp.count(pinned) == 2, mlp  # gate and up merged, down
    assert "self.down_proj = RowParallelLinear(" in mlp
    assert (
        "Unfused: tensor parallel (Gemma3nTextMLP): sharded where "
        "`config.activation_sparsity_pattern[layer_idx] == 0.0` (proven on those "
        "layers), whole on every rank elsewhere (with self.activation_sparsity=0.95 "
        "over 2 ranks it computes something else"
    ) in text


def test_a_kept_value_is_read_at_construction_only_from_the_arguments():
    from codemods.copying import _kept_from_arguments
    from codemods.source import load

    info = load("modeling_gemma3n.py").classes["Gemma3nTextMLP"]
    assert (
        _kept_from_arguments(info, "activation_sparsity")
        == "config.activation_sparsity_pattern[layer_idx]"
    )
    # Gemma 3n's attention derives `is_sliding` from another attribute: not readable
    attention = load("modeling_gemma3n.py").classes["Gemma3nTextAttention"]
    assert _kept_from_arguments(attention, "is_sliding") is None
