"""Mamba-2 mixers read as vLLM's MambaMixer2 and proven against its computation over a
prefill and decode steps with the states carried, and what the pipeline makes of a
proven or a refused mixer (engine-free; the engine runs are in test_hybrid_engine.py).
"""

from __future__ import annotations

import glob
import importlib
import os
import re

import libcst.matchers as m
import pytest

from conftest import edited_modeling_file

from codemods.loading import load_module
from codemods.source import load
from fusion_patterns.base import PatternRefused, Refusal, code
from fusion_patterns.mamba2 import Mamba2Spec, match, prove

MIXERS = {
    "bamba": "BambaMixer",
    "falcon_h1": "FalconH1Mixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "mamba2": "Mamba2Mixer",
    "nemotron_h": "NemotronHMamba2Mixer",
    "zamba2": "Zamba2MambaMixer",
}
SMALL = dict(hidden_size=64, num_hidden_layers=2, vocab_size=128)
# (config class, the mixer's sizes under this config class's names)
CONFIGS = {
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_chunk_size=8,
            mamba_expand=2,
            layer_types=["mamba", "attention"],
        ),
        "mamba_n_groups",
    ),
    "mamba2": (
        "Mamba2Config",
        dict(num_heads=4, head_dim=32, state_size=16, chunk_size=8, expand=2),
        "n_groups",
    ),
    "falcon_h1": (
        "FalconH1Config",
        dict(
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_ssm=128,
            mamba_d_state=16,
            mamba_chunk_size=8,
            mamba_rms_norm=True,
            mamba_norm_before_gate=False,
            ssm_in_multiplier=0.6,
            ssm_multipliers=[0.6, 0.75, 0.9, 1.05, 1.2],
            num_attention_heads=4,
            num_key_value_heads=2,
        ),
        "mamba_n_groups",
    ),
    "zamba2": (
        "Zamba2Config",
        dict(
            n_mamba_heads=4,
            mamba_headdim=32,
            mamba_d_state=16,
            chunk_size=8,
            mamba_expand=2,
            layers_block_type=["mamba", "mamba"],
        ),
        "mamba_ngroups",
    ),
}


def _mixer(name: str, groups: int = 1, path=None, **extra):
    source = load(str(path) if path else f"modeling_{name}.py")
    module = load_module(source, trust_remote_code=path is not None)
    cfg_name, sizes, group_field = CONFIGS[name]
    config = getattr(module, cfg_name, None) or getattr(
        importlib.import_module(f"transformers.models.{name}"), cfg_name
    )
    config = config(**{**SMALL, **sizes, group_field: groups, **extra})
    cls = MIXERS[name]
    return source.classes[cls], getattr(module, cls)(config, layer_idx=0), config


def test_the_six_mamba2_mixers_and_nothing_else_are_read_as_mambamixer2():
    import transformers

    models = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = {}
    for path in sorted(glob.glob(os.path.join(models, "*", "modeling_*.py"))):
        text = open(path).read()
        if "Conv1d" not in text or "A_log" not in text:
            continue  # a candidate builds both: no need to parse the file
        try:
            source = load(os.path.basename(path))
        except Exception:  # noqa: BLE001 - a file the toolkit cannot read: no candidate
            continue
        for name, info in source.classes.items():
            if (spec := match(info)) is not None:
                found[name] = spec
    assert sorted(found) == sorted(MIXERS.values())
    assert all(isinstance(spec, Mamba2Spec) for spec in found.values())


@pytest.mark.parametrize(
    "name, heads, groups, eps",
    [
        (
            "granitemoehybrid",
            "config.mamba_n_heads",
            "config.mamba_n_groups",
            "config.rms_norm_eps",
        ),
        (
            "nemotron_h",
            "config.mamba_num_heads",
            "config.n_groups",
            "config.layer_norm_epsilon",
        ),
        ("zamba2", "config.n_mamba_heads", "config.mamba_ngroups", "1e-5"),
    ],
)
def test_each_argument_is_the_sources_own_expression(name, heads, groups, eps):
    spec = match(load(f"modeling_{name}.py").classes[MIXERS[name]])
    assert code(spec.args["num_heads"]) == heads
    assert code(spec.args["n_groups"]) == groups
    assert code(spec.args["rms_norm_eps"]) == eps
    assert code(spec.args["hidden_size"]) == "config.hidden_size"


@pytest.mark.parametrize("name", ["granitemoehybrid", "mamba2"])
def test_a_mixer_equals_vllms_over_prefill_and_decode_steps(name):
    info, module, config = _mixer(name)
    prove(match(info), module, config)  # raises PatternRefused where it differs


def test_a_norm_over_the_whole_width_is_refused_with_more_than_one_group():
    """Granite 4.0-H's gated norm is over the whole width; vLLM's over each group."""
    info, module, config = _mixer("granitemoehybrid", groups=2)
    with pytest.raises(PatternRefused, match="normalises within each of n_groups=2"):
        prove(match(info), module, config)


def test_a_time_step_floor_is_proven_where_the_floor_is_reached():
    """Zamba 2 floors the time step at config.time_step_min; half the heads' dt_bias
    is drawn far below it, so the floor bites. The generated mixer clamps the raw dt;
    without that clamp the two sides differ."""
    from dataclasses import replace

    info, module, config = _mixer("zamba2", groups=2)
    spec = match(info)
    assert code(spec.time_step_limit) == '(config.time_step_min, float("inf"))'
    prove(spec, module, config)
    with pytest.raises(PatternRefused, match="the mixer over the prompt"):
        prove(replace(spec, time_step_limit=None), module, config)


def test_an_upper_time_step_limit_is_refused():
    info, module, config = _mixer("granitemoehybrid", time_step_limit=(0.0, 0.5))
    with pytest.raises(PatternRefused, match=r"clamps dt from above"):
        prove(match(info), module, config)


def test_zamba2_without_the_floor_is_proven_with_groups():
    """Zamba 2 normalises per group, as vLLM does: with its floor at 0 it is proven
    with two groups."""
    info, module, config = _mixer("zamba2", groups=2, time_step_min=0.0)
    prove(match(info), module, config)


EDITS = {
    "the D skip dropped": (
        "                D=self.D,\n                z=None,\n                return_final_states=output_final_state,",
        "                D=None,\n                z=None,\n                return_final_states=output_final_state,",
        "the mixer over the prompt",
    ),
    "the gate applied after the norm": (
        "            hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))\n        variance",
        "            pass\n        variance",
        "gated norm",
    ),
    "the conv state not carried": (
        "            hidden_states_B_C = causal_conv1d_update(\n                hidden_states_B_C,\n                conv_state,",
        "            hidden_states_B_C = causal_conv1d_update(\n                hidden_states_B_C,\n                torch.zeros_like(conv_state),",
        "decode step 1",
    ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_mixer_is_refused(tmp_path, edit):
    old, new, reason = EDITS[edit]
    path = edited_modeling_file(tmp_path, "modeling_granitemoehybrid.py", old, new)
    info, module, config = _mixer("granitemoehybrid", path=path)
    with pytest.raises(PatternRefused, match=reason):
        prove(match(info), module, config)


def test_a_log_used_without_the_minus_exp_is_not_matched(tmp_path):
    path = edited_modeling_file(
        tmp_path,
        "modeling_granitemoehybrid.py",
        "A = -torch.exp(self.A_log.float())",
        "A = self.A_log.float()",
    )
    spec = match(load(str(path)).classes[MIXERS["granitemoehybrid"]])
    assert isinstance(spec, Refusal)
    assert "A = -exp(self.A_log.float())" in spec.reason


@pytest.mark.parametrize("tp", [1, 2])
def test_the_state_shapes_are_the_mixers_and_equal_vllms_own_granite(tp):
    """The state methods written from the mixer's expressions give, on a Granite 4.0-H
    config, exactly the shapes vLLM's own granitemoehybrid.py gives."""
    import textwrap
    from types import SimpleNamespace

    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateCopyFuncCalculator,
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.model_executor.models.granitemoehybrid import (
        GraniteMoeHybridForCausalLM,
    )

    from fusion_patterns.mamba2.emit import state_shape
    from fusion_patterns.state_layers import MAMBA2, state_methods

    info, _, config = _mixer("granitemoehybrid")
    space = {
        "MambaStateDtypeCalculator": MambaStateDtypeCalculator,
        "MambaStateShapeCalculator": MambaStateShapeCalculator,
        "MambaStateCopyFuncCalculator": MambaStateCopyFuncCalculator,
    }
    exec(
        "class Generated:\n"
        + textwrap.indent(textwrap.dedent(state_methods(MAMBA2, state_shape(match(info)))), "    "),
        space,
    )
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config, hf_text_config=config),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp),
        num_speculative_tokens=0,
    )
    ours = space["Generated"].get_mamba_state_shape_from_config(vllm_config)
    assert ours == GraniteMoeHybridForCausalLM.get_mamba_state_shape_from_config(
        vllm_config
    )
    assert space["Generated"].get_mamba_state_copy_func() == (
        GraniteMoeHybridForCausalLM.get_mamba_state_copy_func()
    )


def test_the_mixer_is_built_from_the_sources_expressions():
    from fusion_patterns.mamba2.emit import construction

    text = construction(match(load("modeling_zamba2.py").classes[MIXERS["zamba2"]]))
    assert text.startswith(
        "with_sharded_bias(MambaMixer2WithTimeStepLimit(hidden_size=config.hidden_size, "
    )
    # its floor on the time step, which vLLM's own mixer does not apply
    assert 'time_step_limit=(config.time_step_min, float("inf")), ' in text
    assert "num_heads=config.n_mamba_heads, " in text
    assert "n_groups=config.mamba_ngroups, " in text
    assert "rms_norm_eps=1e-5, " in text
    assert 'prefix=f"{prefix}.mixer"))' in text
    # Zamba 2 normalises per group (its norm is built from n_groups): no one-group guard
    assert "one_group(" not in text
    compile(text, "<construction>", "eval")


def _generated(name: str, disabled=frozenset()):
    from codemods import pipeline

    outside = "/" in name  # an edited copy: not part of the installed transformers
    return pipeline.generate(name, outside, disabled=frozenset(disabled))


@pytest.fixture(scope="module")
def granite_hybrid():
    return _generated("modeling_granitemoehybrid.py")


def test_a_proven_mixer_is_vllms_layer_built_where_the_source_builds_it(
    granite_hybrid,
):
    plan, text = granite_hybrid
    (record,) = [r for r in plan.records if r.pattern == "mamba2"]
    assert (record.source_class, record.target, record.vllm_class) == (
        "GraniteMoeHybridMambaLayer",
        "mamba",
        "MambaMixer2",
    )
    assert "in_proj" in record.sources and "out_proj" in record.sources
    # the mixer class is not emitted; the layer keeps the source's choice of mixer
    assert "class GraniteMoeHybridMambaLayer" not in text
    assert 'if config.layers_block_type[layer_idx] == "linear_attention":' in text
    assert 'prefix=f"{prefix}.mamba"' in text  # the state cache's key: the module path
    # vLLM's mixer takes one row per token
    assert re.search(
        r"self\.mamba\(hidden_states\.flatten\(0, -2\)\)\.view_as\(\s*hidden_states\s*\)",
        text,
    )
    # Granite's gated norm spans the whole width: one group only, checked at load
    assert "n_groups=one_group(config.mamba_n_groups)" in text


def test_the_causal_lm_is_hybrid_with_the_mixers_state_shapes(granite_hybrid):
    _, text = granite_hybrid
    assert re.search(
        r"class GraniteMoeHybridForCausalLM\(\s*nn\.Module, HasInnerState, IsHybrid,",
        text,
    )
    for method in (
        "get_mamba_state_shape_from_config",
        "get_mamba_state_dtype_from_config",
        "get_mamba_state_copy_func",
    ):
        assert f"def {method}(cls" in text
    # the checkpoint's A_log is loaded into the mixer's A (whose loader takes -exp)
    assert "self._mamba2_a(weights)" in text


def test_the_one_group_guard_refuses_a_grouped_config_in_one_line(granite_hybrid):
    from fusion_patterns.mamba2.emit import ONE_GROUP

    space: dict = {}
    exec(ONE_GROUP, space)
    assert space["one_group"](1) == 1
    with pytest.raises(ValueError, match="n_groups=2: this model's gated norm spans"):
        space["one_group"](2)


def test_a_mixer_no_pattern_claims_is_not_generated():
    """With the pattern off, the mixer would be copied with transformers' cache calls:
    the file is refused, naming the layer."""
    from codemods.errors import CodemodError

    with pytest.raises(CodemodError) as err:
        _generated("modeling_granitemoehybrid.py", {"mamba2"})
    assert str(err.value).startswith(
        "cannot generate: GraniteMoeHybridMambaLayer keeps state across decode steps"
    )
    assert "its pattern did not run" in str(err.value)


def test_a_mixer_whose_proof_fails_is_refused_with_the_proofs_reason(tmp_path):
    from codemods.errors import CodemodError

    old, new, reason = EDITS["the D skip dropped"]
    path = edited_modeling_file(tmp_path, "modeling_granitemoehybrid.py", old, new)
    with pytest.raises(CodemodError) as err:
        _generated(str(path))
    assert "GraniteMoeHybridMambaLayer keeps state" in str(err.value)
    assert reason in str(err.value)


def test_bamba_layers_appended_in_a_loop_are_vllms_make_layers():
    """Bamba builds its layers with `for i in range(n): layers.append(Layer(...))` and
    places its attention layers by `attn_layer_indices`: read as the comprehension it
    is, each layer told its own type."""
    plan, text = _generated("modeling_bamba.py")
    assert [r.target for r in plan.records if r.pattern == "mamba2"] == ["mamba"]
    assert "decoder_layers" not in text
    assert re.search(
        r"make_layers\(\s*config\.num_hidden_layers,\s*lambda prefix: BambaDecoderLayer\("
        r"\s*config,\s*layer_idx=extract_layer_index\(prefix\),\s*"
        r"layer_type=config\.layers_block_type\[extract_layer_index\(prefix\)\],",
        text,
    )


def test_mamba_2_alone_is_an_attention_free_model_set_up_as_vllm_sets_up_its_own():
    """Mamba 2 has no attention: the causal LM is IsAttentionFree (no KV cache), and
    the plugin enters the architecture in vLLM's per-architecture setup as vLLM's own
    Mamba2ForCausalLM is (MambaModelConfig sizes the state blocks)."""
    from vllm.model_executor.models import config as vllm_config

    import generated

    plan, text = _generated("modeling_mamba2.py")
    assert plan.vllm_config == "MambaModelConfig"
    assert re.search(
        r"class Mamba2ForCausalLM\(\s*nn\.Module, HasInnerState, IsAttentionFree,", text
    )
    assert "IsHybrid" not in text
    # torch's load_state_dict hook (old checkpoint names) is not vLLM's loader's
    assert "_register_load_state_dict_pre_hook" not in text
    assert "# vllm config:   MambaModelConfig" in text
    target, setup = generated._headers()["GeneratedMamba2ForCausalLM"]
    assert (target, setup) == ("generated.mamba2:Mamba2ForCausalLM", "MambaModelConfig")
    generated.set_up("GeneratedMamba2ForCausalLM", setup)
    assert (
        vllm_config.MODELS_CONFIG_MAP["GeneratedMamba2ForCausalLM"]
        is vllm_config.MambaModelConfig
    )
    # a file beside attention gets no such entry
    assert generated._headers()["GeneratedBambaForCausalLM"][1] == ""


# --- Falcon-H1: the in-projection's scales, an optional norm, a flag vLLM lacks ------


def _falcon_mixer(**extra):
    from transformers.models.falcon_h1.modeling_falcon_h1 import compute_mup_vector

    info, module, config = _mixer("falcon_h1", **extra)
    # the owner registers the per-part scales on each mixer (FalconH1Model.__init__)
    module.register_buffer("mup_vector", compute_mup_vector(config), persistent=False)
    return info, module, config


def test_falcon_h1_reads_its_scales_and_its_optional_norm():
    spec = match(load("modeling_falcon_h1.py").classes[MIXERS["falcon_h1"]])
    assert code(spec.in_scale) == "config.ssm_in_multiplier"
    assert spec.out_scale == "mup_vector"  # registered by its owner, not __init__
    assert code(spec.use_rms_norm) == "config.mamba_rms_norm"


def test_falcon_h1_is_proven_with_its_scales_and_the_norm_order_it_cannot_take():
    """Proven with the scales folded into the in-projection; each flag its __init__
    reads flipped and proven again: the norm after the gate only where a norm is built
    at all is what vLLM's mixer lacks."""
    from dataclasses import replace

    info, module, config = _falcon_mixer()
    unproven = prove(match(info), module, config)
    assert unproven == ((("mamba_norm_before_gate", True), ("mamba_rms_norm", True)),)
    # without the output's per-part scales the two sides differ
    with pytest.raises(PatternRefused, match="the mixer over the prompt"):
        prove(replace(match(info), out_scale=None), module, config)
    with pytest.raises(PatternRefused, match="the mixer over the prompt"):
        prove(replace(match(info), in_scale=None), module, config)


def test_falcon_h1_without_its_norm_is_the_gate_alone():
    info, module, config = _falcon_mixer(mamba_rms_norm=False)
    assert type(module.norm).__name__ == "Identity"
    prove(match(info), module, config)


@pytest.fixture(scope="module")
def falcon_h1():
    return _generated("modeling_falcon_h1.py")


def test_falcon_h1_generated_folds_the_scales_and_guards_the_flag(falcon_h1):
    _, text = falcon_h1
    # the owner's registration on vLLM's mixer and the vector it registered: not copied
    assert "register_buffer" not in text
    assert "mup_vector = compute_mup_vector(config)" not in text
    # folded into the checkpoint's in-projection before vLLM's loader shards it
    assert "self._mamba2_scales(self._mamba2_a(weights))" in text
    assert "compute_mup_vector(config)" in text
    assert "use_rms_norm=config.mamba_rms_norm" in text
    assert "proven_for(" in text
    assert '{"mamba_norm_before_gate": True, "mamba_rms_norm": True}' in text


def test_the_proven_for_guard_refuses_the_unproven_setting_in_one_line():
    from types import SimpleNamespace

    from fusion_patterns.mamba2.emit import PROVEN_FOR

    space: dict = {"MambaMixer2": object}
    exec(PROVEN_FOR, space)
    unproven = ({"mamba_norm_before_gate": True, "mamba_rms_norm": True},)
    fine = SimpleNamespace(mamba_norm_before_gate=True, mamba_rms_norm=False)
    assert space["proven_for"](fine, unproven, "mixer") == "mixer"
    bad = SimpleNamespace(mamba_norm_before_gate=True, mamba_rms_norm=True)
    with pytest.raises(ValueError, match="^mamba_norm_before_gate=True, mamba_rms"):
        space["proven_for"](bad, unproven, "mixer")


# --- Nemotron-H: the mixer picked per layer from a table of classes ------------------


def test_a_call_in_a_keyed_branch_reaches_that_keys_class():
    import libcst as cst

    from fusion_patterns.base import ClassTable, branch_keys

    forward = cst.parse_module(
        "def forward(self, x):\n"
        "    if self.block_type == 'mamba':\n"
        "        x = self.mixer(x, cache_params=None)\n"
        "    elif self.block_type == 'attention':\n"
        "        x = self.mixer(hidden_states=x)\n"
        "    else:\n"
        "        x = self.mixer(x)\n"
        "    return x\n"
    )
    table = ClassTable("self.block_type", {"mamba": "Mixer", "attention": "Attn"})
    branches = branch_keys(forward)
    calls = [
        c for c in m.findall(forward, m.Call(func=m.Attribute(attr=m.Name("mixer"))))
    ]
    assert [table.class_at(branches.get(id(c))) for c in calls] == [
        "Mixer",
        "Attn",
        None,  # the else branch: no key says which
    ]
    # a branch on another expression says nothing about this table
    assert (
        ClassTable("self.kind", {"mamba": "Mixer"}).class_at(branches.get(id(calls[0])))
        is None
    )


@pytest.fixture(scope="module")
def nemotron_h():
    return _generated("modeling_nemotron_h.py")


def test_nemotron_h_builds_each_layers_class_from_its_table(nemotron_h):
    """`MIXER_TYPES[self.block_type](config, layer_idx=layer_idx)`: each class built as
    the copy builds it (the Mamba-2 one as vLLM's mixer), the per-layer choice kept;
    only the Mamba-2 branch's call takes vLLM's one row per token."""
    _, text = nemotron_h
    table = text[text.index("self.mixer = {") : text.index("}[self.block_type]()")]
    assert '"linear_attention": lambda: with_sharded_bias(' in table
    assert "MambaMixer2WithTimeStepLimit(" in table
    assert '"full_attention": lambda: NemotronHAttention(' in table
    assert '"moe": lambda: NemotronHMoE(' in table
    assert '"mlp": lambda: NemotronHMLP(' in table
    assert table.count('prefix=f"{prefix}.mixer"') == 4
    assert "class NemotronHMamba2Mixer" not in text
    assert "self.mixer(hidden_states.flatten(0, -2)).view_as(" in text
    assert text.count(".flatten(0, -2)).view_as(") == 1
    assert "hidden_states = self.mixer(hidden_states)\n" in text  # MLP / MoE


def test_a_mixer_from_a_table_no_pattern_claims_is_refused_not_copied():
    """With the pattern off, Nemotron-H's Mamba-2 mixer (built through its table, so
    the rules over layer types never name it) is refused: a copy would keep
    transformers' cache."""
    from codemods.errors import CodemodError

    with pytest.raises(CodemodError, match="NemotronHMamba2Mixer keeps state"):
        _generated("modeling_nemotron_h.py", disabled={"mamba2"})
