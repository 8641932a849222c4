"""Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba) read as vLLM's MambaMixer and proven
against the generated mixer's computation over a prefill and decode steps with the
states carried; copies of the source with one thing wrong are refused (engine-free;
the engine runs are at the end, marked)."""

from __future__ import annotations

import glob
import importlib
import json
import os

import pytest
import torch

from conftest import edited_modeling_file, run_cli

from codemods.loading import load_module
from codemods.source import load
from fusion_patterns.base import PatternRefused, Refusal, code
from fusion_patterns.mamba1 import Mamba1Spec, match, prove
from fusion_patterns.mamba1.proof import norm_weights

MIXERS = {
    "mamba": "MambaMixer",
    "falcon_mamba": "FalconMambaMixer",
    "jamba": "JambaMambaMixer",
}
CONFIGS = {
    "mamba": ("MambaConfig", dict(state_size=8, expand=2, time_step_rank=6)),
    "falcon_mamba": (
        "FalconMambaConfig",
        dict(state_size=8, expand=2, time_step_rank=6, mixer_rms_eps=1e-5),
    ),
    "jamba": (
        "JambaConfig",
        dict(mamba_d_state=8, mamba_expand=2, mamba_dt_rank=6, mamba_proj_bias=True),
    ),
}


def _mixer(name: str, path=None, **extra):
    source = load(str(path) if path else f"modeling_{name}.py")
    module = load_module(source, trust_remote_code=path is not None)
    cfg_name, sizes = CONFIGS[name]
    config = getattr(importlib.import_module(f"transformers.models.{name}"), cfg_name)
    config = config(
        hidden_size=48, num_hidden_layers=2, vocab_size=128, **{**sizes, **extra}
    )
    cls = getattr(module, MIXERS[name])
    try:  # as the source's blocks build it: the model initialises its weights
        mixer = cls(config, layer_idx=0, initialize_mixer_weights=False)
    except TypeError:
        mixer = cls(config, layer_idx=0)
    with torch.no_grad():  # S4D's real initialization, as the model's would give
        n = mixer.A_log.shape[-1]
        mixer.A_log.copy_(torch.log(torch.arange(1, n + 1.0)).expand_as(mixer.A_log))
        mixer.D.fill_(1.0)
    return source.classes[MIXERS[name]], mixer, config


def test_the_three_mamba_1_mixers_and_nothing_else_are_read_as_mambamixer():
    import transformers

    models = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = {}
    for path in sorted(glob.glob(os.path.join(models, "*", "modeling_*.py"))):
        text = open(path).read()
        if "Conv1d" not in text or "A_log" not in text:
            continue
        try:
            source = load(os.path.basename(path))
        except Exception:  # noqa: BLE001 - a file the toolkit cannot read: no candidate
            continue
        for name, info in source.classes.items():
            if (spec := match(info)) is not None:
                found[name] = spec
    assert sorted(found) == sorted(MIXERS.values())
    assert all(isinstance(spec, Mamba1Spec) for spec in found.values())


def test_the_arguments_are_the_sources_own_expressions():
    spec = match(_mixer("jamba")[0])
    assert code(spec.args["ssm_state_size"]) == "config.mamba_d_state"
    assert code(spec.args["intermediate_size"]) == (
        "config.mamba_expand * config.hidden_size"
    )
    assert code(spec.args["time_step_rank"]) == "config.mamba_dt_rank"
    assert code(spec.args["use_bias"]) == "config.mamba_proj_bias"
    assert code(spec.args["rms_norm_eps"]) == "config.rms_norm_eps"
    assert spec.normed and not match(_mixer("mamba")[0]).normed


def test_falcon_mambas_norms_hold_no_weight_and_jambas_do():
    info, module, _ = _mixer("falcon_mamba")
    assert norm_weights(match(info), module) is False
    info, module, _ = _mixer("jamba")
    assert norm_weights(match(info), module) is True


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_a_mixer_equals_the_generated_one_over_prefill_and_decode_steps(name):
    info, module, config = _mixer(name)
    spec = match(info)
    from dataclasses import replace

    spec = replace(spec, norm_weights=norm_weights(spec, module))
    prove(spec, module, config, constants={"initialize_mixer_weights": False})


# (what is wrong, file, old text, new text, what the proof says differs)
EDITS = {
    "the SSM state reset between decode steps": (
        "modeling_mamba.py",
        "            recurrent_state = cache_params.layers[self.layer_idx].recurrent_states[0]\n",
        "            recurrent_state = cache_params.layers[self.layer_idx].recurrent_states[0].zero_()\n",
        "decode step 1",
    ),
    "the D skip dropped": (
        "modeling_mamba.py",
        "        scan_output = scan_output + hidden_states * D[None, :, None]\n",
        "        scan_output = scan_output\n",
        "the mixer over the prompt",
    ),
    "the B norm dropped": (
        "modeling_falcon_mamba.py",
        "        B = self.b_layernorm(B)\n",
        "        B = B\n",
        "the mixer over the prompt",
    ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_mixer_is_refused(tmp_path, edit):
    name, old, new, reason = EDITS[edit]
    path = edited_modeling_file(tmp_path, name, old, new)
    model = name.removeprefix("modeling_").removesuffix(".py")
    info, module, config = _mixer(model, path=path)
    spec = match(info)
    assert isinstance(spec, Mamba1Spec)
    from dataclasses import replace

    spec = replace(spec, norm_weights=norm_weights(spec, module))
    with pytest.raises(PatternRefused, match=reason):
        prove(spec, module, config, constants={"initialize_mixer_weights": False})


def test_a_dt_proj_without_bias_is_refused_by_name(tmp_path):
    path = edited_modeling_file(
        tmp_path,
        "modeling_mamba.py",
        "self.dt_proj = nn.Linear(self.time_step_rank, self.intermediate_size, bias=True)",
        "self.dt_proj = nn.Linear(self.time_step_rank, self.intermediate_size, bias=False)",
    )
    spec = match(load(str(path)).classes["MambaMixer"])
    assert isinstance(spec, Refusal)
    assert "self.dt_proj is built with bias=False" in spec.reason


def test_the_generated_mamba_state_shape_is_vllms_own():
    from types import SimpleNamespace

    from vllm.model_executor.models.mamba import MambaForCausalLM as Native

    from generated import mamba

    text = open(mamba.__file__).read()
    assert "self.mixer = MambaMixerOnCPU(" in text and "class MambaMixer(" not in text
    assert "HasInnerState, IsAttentionFree" in text
    config = _mixer("mamba")[2]
    for tp in (1, 2):
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(hf_config=config, hf_text_config=config),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
            num_speculative_tokens=0,
        )
        ours = mamba.MambaForCausalLM.get_mamba_state_shape_from_config(vllm_config)
        assert ours == Native.get_mamba_state_shape_from_config(vllm_config)


def _verify(*args: str) -> dict:
    result = run_cli("codemods.verify", *args)
    lines = result.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines else {}
    assert result.returncode == 0, (out, result.stderr[-2000:])
    return out


@pytest.mark.engine
def test_falcon_mamba_in_vllm():
    """Weightless norms on the time step, B and C; vLLM's CPU build has no Mamba-1
    scan kernel, so the generated mixer's torch scan runs here, 8 decode steps."""
    out = _verify("falcon_mamba")
    assert out["ok"], out
    assert out["impl"] == "generated.falcon_mamba:FalconMambaForCausalLM", out
    assert out["tokens_equal"] and out["max_abs_logprob_diff"] <= 1e-4


def test_jamba_builds_each_layer_kind_from_its_table_with_vllms_arguments():
    """Jamba picks each layer's class from a module-level table and its feed-forward
    block through a local (`ffn_layer_class = MoeBlock if n > 1 else MLP`): the
    committed file names both layer classes in make_layers, and each feed-forward block
    gets its prefix (vLLM's FusedMoE is keyed by it: without it, two layers collide)."""
    path = os.path.join(os.path.dirname(__file__), "..", "generated", "jamba.py")
    flat = " ".join(open(path).read().split())
    assert (
        'lambda prefix: { "attention": JambaAttentionDecoderLayer, "mamba": '
        "JambaMambaDecoderLayer, }[config.layers_block_type[extract_layer_index(prefix)]]"
    ) in flat
    built = (
        "ffn_layer_class( config, quant_config=quant_config, "
        'prefix=f"{prefix}.feed_forward" )'
    )
    assert flat.count(built) == 2
    assert "ALL_DECODER_LAYER_TYPES" not in flat


@pytest.mark.engine
def test_jamba_in_vllm():
    """Mamba-1 layers next to attention layers without rope, MoE blocks next to dense
    ones (every layer kind the config can place), 8 decode steps."""
    out = _verify("jamba")
    assert out["ok"] and out["impl"] == "generated.jamba:JambaForCausalLM", out
    assert out["tokens_equal"] and out["max_abs_logprob_diff"] <= 1e-4
    assert {
        "JambaMambaDecoderLayer",
        "JambaAttentionDecoderLayer",
        "JambaSparseMoeBlock",
        "JambaMLP",
    } <= set(out["kinds"])


def test_a_norm_built_only_inside_a_claimed_mixer_is_not_reported(tmp_path):
    """Falcon-Mamba's weightless dt/B/C norms live inside its mixer, which vLLM's
    MambaMixer replaces whole (its own norms, proven with the mixer): no norm line."""
    result = run_cli(
        "codemods.apply", "modeling_falcon_mamba.py", "--out", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    report = result.stdout + result.stderr
    assert "Fused: in_proj + conv1d + x_proj + dt_proj + dt/B/C norms" in report
    assert "FalconMambaWeightlessRMSNorm" not in report
