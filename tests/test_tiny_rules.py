"""Tiny-config rules over a config class's own fields and its modeling source's names,
engine-free: each on a class that needs it (the model builds and runs only with it)."""

from __future__ import annotations

import pytest

from codemods import tiny


def _causal(name: str):
    from codemods import loading, roles
    from codemods.source import load

    src = load(name)
    return roles.causal_class(loading.load_module(src), src.classes, src)


FULL_SLIDING = [
    "full_attention",
    "sliding_attention",
    "sliding_attention",
    "full_attention",
]


@pytest.mark.parametrize(
    "kinds, types",
    [
        # full and sliding mixed, full on both ends (written out: not the constant)
        (None, FULL_SLIDING),
        (["sliding_attention", "full_attention"], FULL_SLIDING),
        (
            ["conv", "full_attention"],
            ["conv", "full_attention", "full_attention", "conv"],
        ),
        (["full_attention"], ["full_attention"] * 4),
    ],
)
def test_layer_types_mix_the_kinds_the_source_names(kinds, types):
    assert tiny.mixed_layer_types(kinds) == types


def test_layer_kinds_are_read_from_the_modeling_source():
    # LFM2-MoE builds short convolutions and full attention, no sliding window: the
    # usual full/sliding pattern would key its mask mapping by a kind it never builds
    cls = _causal("modeling_lfm2_moe.py")
    assert set(tiny.source_layer_kinds(cls)) == {"conv", "full_attention"}
    values = tiny.working_values(cls)
    assert set(values["layer_types"]) == {"conv", "full_attention"}
    assert values["num_hidden_layers"] == len(values["layer_types"])


def test_a_count_of_layers_sized_for_the_full_depth_fits_the_tiny_one():
    # Gemma 3n shares the KV of its last `num_kv_shared_layers` (15 by default) layers,
    # and embeds a per-layer input over its own 262k vocabulary
    cls = _causal("modeling_gemma3n.py")
    values = tiny.tiny_values(cls.config_class, None, tiny.source_layer_kinds(cls))
    assert 0 < values["num_kv_shared_layers"] < values["num_hidden_layers"]
    assert values["vocab_size_per_layer_input"] == tiny.VOCAB
    from codemods.tiny_model import check_runs

    check_runs(cls, values)  # raises where the model does not build or run


def test_a_per_layer_list_derived_from_the_depth_keeps_its_kinds_at_the_tiny_one():
    # Gemma 3n derives its activation sparsity from its depth (0.95 on the first 10 of
    # 35 layers): at 4 layers it would be 0 everywhere, and the sparse MLP (a mean and
    # a deviation over its whole width) never built, proven or verified
    cls = _causal("modeling_gemma3n.py")
    values = tiny.working_values(cls)
    assert values["activation_sparsity_pattern"] == [0.95, 0.95, 0.0, 0.0]
    config = cls.config_class(**values)
    assert config.activation_sparsity_pattern == [0.95, 0.95, 0.0, 0.0]


def test_a_layer_type_list_under_the_configs_own_name_fits_the_tiny_depth():
    # Zamba 2 keeps its layer kinds in `layers_block_type` (aliased as layer_types),
    # filled for 54 layers by default: a tiny depth of 4 did not validate against it
    cls = _causal("modeling_zamba2.py")
    values = tiny.tiny_values(cls.config_class, None, tiny.source_layer_kinds(cls))
    kinds = values["layers_block_type"]
    assert set(kinds) == {"linear_attention", "hybrid"}
    assert values["num_hidden_layers"] == len(kinds)
    config = cls.config_class(**values)
    # more hybrid layers than shared blocks: the tiny model ties a block
    assert len(config.hybrid_layer_ids) > config.num_mem_blocks


def test_an_experts_top_k_unset_by_default_is_set_with_the_experts():
    # Gemma 4's MoE block is a switch off by default, with `top_k_experts` None: on,
    # it needs a top-k, and the tiny model builds its router and experts
    cls = _causal("modeling_gemma4.py")
    values = tiny.working_values(cls)
    assert values["enable_moe_block"] is True
    assert values["top_k_experts"] == 2


def test_a_count_the_class_validates_at_its_default_is_kept_at_it():
    # ZAYA's validator accepts top-1 routing only: the tiny top-k (2) fails it, and the
    # class default (1), smaller still, builds
    cls = _causal("modeling_zaya.py")
    plain = tiny.tiny_values(cls.config_class, None, tiny.source_layer_kinds(cls))
    assert plain["num_experts_per_tok"] > 1
    with pytest.raises(Exception, match="num_experts_per_tok=1"):
        cls.config_class(**plain)
    assert tiny.working_values(cls)["num_experts_per_tok"] == 1


def test_a_list_of_multipliers_gets_a_value_per_part():
    """Falcon-H1 scales each part of its mixer's in-projection by its own multiplier:
    all 1.0 by default, which would let a part scaled by another's pass."""
    from transformers import FalconH1Config

    values = tiny.feature_values(FalconH1Config)
    assert values["ssm_multipliers"] == [0.6, 0.75, 0.9, 1.05, 1.2]
    assert values["mlp_multipliers"] == [0.6, 0.75]
    assert values["mamba_norm_before_gate"] is False  # the order vLLM's norm takes


def test_a_kind_placed_every_period_layers_is_built_in_the_tiny_depth():
    # Jamba places attention every 8th layer from the 4th (none in four layers): every
    # other layer from the 1st, so Mamba and attention layers are both built; its MoE
    # blocks (every 2nd from the 1st) already fall inside
    cls = _causal("modeling_jamba.py")
    values = tiny.tiny_values(cls.config_class, None, tiny.source_layer_kinds(cls))
    config = cls.config_class(**values)
    assert set(config.layers_block_type) == {"mamba", "attention"}
    assert (values["attn_layer_period"], values["attn_layer_offset"]) == (2, 1)
    assert "expert_layer_period" not in values


def test_a_layer_count_set_through_a_property_and_experts_under_their_own_name():
    # LongCat-Flash derives `num_hidden_layers` (a property with a setter) as twice its
    # `num_layers` field (28: the tiny rules did not shrink it), and adds 256 identity
    # experts (`zero_expert_num`) to each router and stacked gate/up parameter:
    # 675M parameters, refused by the size guard
    cls = _causal("modeling_longcat_flash.py")
    values = tiny.tiny_values(cls.config_class, None, tiny.source_layer_kinds(cls))
    config = cls.config_class(**values)
    assert config.num_hidden_layers == tiny.SIZES["num_hidden_layers"]
    assert values["num_layers"] == tiny.SIZES["num_hidden_layers"] // 2
    assert values["zero_expert_num"] == tiny.SIZES["num_experts"]
    from codemods.tiny_model import check_runs

    check_runs(cls, values)  # raises where the model is large or does not run


def test_a_layer_list_shorter_than_the_configs_count_is_found_by_its_layers():
    # LongCat-Flash's config counts two attention sublayers per decoder layer: no list
    # holds `num_hidden_layers` layers, its one list of decoder layers is the layers;
    # HRM's two stacks of decoder layers are two lists, named in the refusal
    from codemods.errors import CodemodError

    found = _roles("modeling_longcat_flash.py")
    assert found.layers_attr == "layers"
    assert found.base.name == "LongcatFlashModel"
    with pytest.raises(CodemodError, match=r"2 lists of decoder layers .*H_module"):
        _roles("modeling_hrm_text.py")


def _roles(name: str):
    """source -> probe -> roles, without running the patterns."""
    from codemods import loading, probe, roles
    from codemods.source import load

    src = load(name)
    module = loading.load_module(src)
    causal = roles.causal_class(module, src.classes, src)
    found = probe.probe(module, src.classes, causal, None)
    return roles.find(src, module, causal, found)


def test_towers_beside_the_text_model_shrink_through_their_sub_configs():
    """Phi-4-multimodal's causal LM builds an audio and an image tower from sub-configs
    the text sizes do not reach (875M parameters at the tiny text sizes): their own
    hidden sizes and depths shrink too, and the model runs small."""
    from codemods.tiny_model import MAX_TINY_PARAMETERS, check_runs

    cls = _causal("modeling_phi4_multimodal.py")
    plain = tiny.tiny_values(cls.config_class, None, tiny.source_layer_kinds(cls))
    with pytest.raises(ValueError, match=r"875M parameters, \d+M of them in model\."):
        check_runs(cls, plain)
    parts = tiny.smaller_parts(cls.config_class, plain)
    assert parts["vision_config"]["hidden_size"] == tiny.SIZES["hidden_size"]
    assert parts["audio_config"]["hidden_size"] == tiny.SIZES["hidden_size"]
    values = tiny.working_values(cls)
    config = cls.config_class(**values)
    assert config.vision_config.hidden_size < 1152  # the class's default
    import torch

    with torch.device("meta"):
        size = sum(p.numel() for p in cls(config).parameters())
    assert size < MAX_TINY_PARAMETERS


def test_the_guard_names_the_parameter_no_rule_shrinks():
    """BLT's hashed byte n-gram table: the tiny-size guard names where the parameters
    are, so the field behind them can be found."""
    cls = _causal("modeling_blt.py")
    with pytest.raises(ValueError) as caught:
        tiny.working_values(cls)
    assert "M of them in model.encoder_hash_tok_embedding" in str(caught.value)
    parts = tiny.smaller_parts(
        cls.config_class, tiny.tiny_values(cls.config_class, None, None)
    )
    assert parts["encoder_hash_byte_group_vocab"] == tiny.VOCAB


def test_the_decoders_layer_list_is_the_one_that_ran():
    """Phi-4-multimodal's image tower holds as many layers as the tiny text model: the
    decoder's list is the one the token-ids forward ran, and the embedding extension
    `__init__` builds after the layers runs before them (the first pipeline rank)."""
    found = _roles("modeling_phi4_multimodal.py")
    assert found.chain == ["model"] and found.layers_attr == "layers"
    assert found.placement["embed_tokens_extend"] == "first"
    assert found.placement["norm"] == "last"
