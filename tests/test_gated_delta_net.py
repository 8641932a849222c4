"""Gated DeltaNet (Qwen3-Next's, Qwen3.5's, OLMo Hybrid's linear attention) read as
vLLM's QwenGatedDeltaNetAttention or OlmoHybridGatedDeltaNetAttention and proven against
its CPU computation (bf16, within a
measured multiple of the source's own bf16 error) over a prefill and decode steps with
the conv and recurrent states carried; copies of the source with one thing wrong are
refused with the step that differs (engine-free; the engine runs are at the end,
marked)."""

from __future__ import annotations

import glob
import importlib
import json
import os
from pathlib import Path

import pytest

from conftest import edited_modeling_file, run_cli

from codemods.loading import load_module
from codemods.source import load
from fusion_patterns.base import PatternRefused, Refusal, code
from fusion_patterns.gated_delta_net import GatedDeltaNetSpec, match, prove

# model -> (the layer's class, its config class)
LAYERS = {
    "qwen3_next": ("Qwen3NextGatedDeltaNet", "Qwen3NextConfig"),
    "qwen3_5": ("Qwen3_5GatedDeltaNet", "Qwen3_5TextConfig"),
    "qwen3_5_moe": ("Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeTextConfig"),
    "olmo_hybrid": ("OlmoHybridGatedDeltaNet", "OlmoHybridConfig"),
}


def _layer(name: str, path=None, **extra):
    source = load(str(path) if path else f"modeling_{name}.py")
    module = load_module(source, trust_remote_code=path is not None)
    cls, config_cls = LAYERS[name]
    config = getattr(importlib.import_module(f"transformers.models.{name}"), config_cls)
    # head sizes vLLM's CPU kernels take (multiples of 64), kv heads below v heads
    config = config(
        hidden_size=96,
        num_hidden_layers=2,
        vocab_size=128,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        **extra,
    )
    return source.classes[cls], getattr(module, cls)(config, layer_idx=0), config


def test_the_gated_delta_nets_of_transformers_are_read_onto_vllms_two_layers():
    """Every class of the installed transformers the pattern takes up, onto the vLLM
    layer whose fields and names it has; none refused."""
    import transformers

    from fusion_patterns.gated_delta_net.match import OLMO, QWEN

    models = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = {}
    for path in sorted(glob.glob(os.path.join(models, "*", "modeling_*.py"))):
        text = open(path).read()
        if "Conv1d" not in text or "A_log" not in text or "dt_bias" not in text:
            continue
        try:
            source = load(os.path.basename(path))
        except Exception:  # noqa: BLE001 - a file the toolkit cannot read: no candidate
            continue
        for name, info in source.classes.items():
            if (spec := match(info)) is not None:
                found[name] = spec
    assert all(isinstance(s, GatedDeltaNetSpec) for s in found.values()), found
    # Qwen4-Exp's text model builds the same layer (its row is refused for its tiny
    # config, not for this layer)
    assert set(found) == {cls for cls, _ in LAYERS.values()} | {
        "Qwen4ExpTextGatedDeltaNet"
    }
    assert found["OlmoHybridGatedDeltaNet"].target is OLMO
    assert {found[cls].target.vllm_class for cls, _ in LAYERS.values()} == {
        QWEN.vllm_class,
        OLMO.vllm_class,
    }


def test_a_scaled_beta_gate_is_refused_onto_qwens_layer(tmp_path):
    """vLLM's Qwen layer takes beta = sigmoid(b): a copy of Qwen3-Next scaling it (as
    OLMo Hybrid's negative eigenvalues do) is refused, in one line, by the match."""
    path = edited_modeling_file(
        tmp_path,
        "modeling_qwen3_next.py",
        "        beta = b.sigmoid()\n",
        "        beta = b.sigmoid()\n        beta = beta * 2.0\n",
    )
    refusal = match(_layer("qwen3_next", path=path)[0])
    assert isinstance(refusal, Refusal)
    assert refusal.reason.startswith("it scales a sigmoid gate (`beta = beta * 2.0`)")


def test_olmo_hybrid_without_its_beta_scaling_is_refused(tmp_path):
    """OLMo Hybrid's layer doubles beta where the config allows negative eigenvalues
    (its default); a copy that never does differs from vLLM's over the prompt."""
    path = edited_modeling_file(
        tmp_path,
        "modeling_olmo_hybrid.py",
        "        if self.allow_neg_eigval:\n            beta = beta * 2.0\n",
        "",
    )
    info, module, config = _layer("olmo_hybrid", path=path)
    assert config.linear_allow_neg_eigval
    with pytest.raises(PatternRefused, match="over the prompt"):
        prove(match(info), module, config)


def test_a_layer_kind_picked_by_a_conditional_expression_is_one_call():
    import libcst as cst

    from codemods.roles import _one_call

    elt = cst.parse_expression(
        "A(config, i) if config.kinds[i] == 'x' else B(config, i)"
    )
    assert code(_one_call(elt)) == "(A if config.kinds[i] == 'x' else B)(config, i)"
    differs = cst.parse_expression("A(config, i) if c else B(config)")
    assert _one_call(differs) is differs


def test_the_fields_are_the_sources_expressions_and_the_layouts_its_projections():
    spec = match(_layer("qwen3_next")[0])
    assert code(spec.fields["linear_num_key_heads"]) == "config.linear_num_key_heads"
    assert (
        code(spec.fields["linear_conv_kernel_dim"]) == "config.linear_conv_kernel_dim"
    )
    assert spec.interleaved and spec.stacked() == []
    flat = match(_layer("qwen3_5")[0])
    assert flat.in_projs == ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
    assert flat.stacked() == [
        (("in_proj_qkv", "in_proj_z"), "in_proj_qkvz", ((0, 1, 2), 3)),
        (("in_proj_b", "in_proj_a"), "in_proj_ba", (0, 1)),
    ]


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_a_gated_delta_net_equals_vllms_over_prefill_and_decode_steps(name):
    info, module, config = _layer(name)
    prove(match(info), module, config)


def test_the_interleaved_layout_read_as_flat_is_refused():
    """The proof, not the match, decides the layout: Qwen3-Next's interleaved
    projections computed as Qwen3.5's flat ones differ over the prompt."""
    from dataclasses import replace

    import torch

    info, module, config = _layer("qwen3_next")
    spec = match(info)
    # the same two weights, split in four as the flat layout splits them
    qkv = 2 * 2 * 64 + 4 * 64
    parts = {
        "flat_qkv": module.in_proj_qkvz.weight[:qkv],
        "flat_z": module.in_proj_qkvz.weight[qkv:],
        "flat_b": module.in_proj_ba.weight[:4],
        "flat_a": module.in_proj_ba.weight[4:],
    }
    for name, weight in parts.items():
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data.copy_(weight)
        setattr(module, name, linear)
    with pytest.raises(PatternRefused, match="over the prompt"):
        prove(replace(spec, in_projs=tuple(parts)), module, config)


# (what is wrong, old text, new text, what the proof says differs)
EDITS = {
    "the decay without -exp(A_log)": (
        "        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)\n",
        "        g = -F.softplus(a.float() + self.dt_bias)\n",
        "over the prompt",
    ),
    "the beta gate dropped": (
        "        beta = b.sigmoid()\n",
        "        beta = torch.ones_like(b)\n",
        "over the prompt",
    ),
    "the recurrent state reset between decode steps": (
        "        recurrent_state = cache_params.layers[self.layer_idx].recurrent_states[0]"
        " if use_precomputed_states else None\n",
        "        recurrent_state = None\n",
        "decode step 1",
    ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_gated_delta_net_is_refused(tmp_path, edit):
    old, new, reason = EDITS[edit]
    path = edited_modeling_file(tmp_path, "modeling_qwen3_next.py", old, new)
    info, module, config = _layer("qwen3_next", path=path)
    with pytest.raises(PatternRefused, match=reason):
        prove(match(info), module, config)


def test_the_generated_files_build_vllms_layer_and_its_state_cache():
    """The committed files: the layer is vLLM's under the checkpoint's names (Qwen3.5's
    four projections stacked into vLLM's two), the causal LM a hybrid whose state shape
    and copy functions are vLLM's own qwen3_next.py's on the same config, and the
    header says the CPU build runs it in bf16."""
    from types import SimpleNamespace

    from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM as Native

    from codemods.verify import read_header
    from generated import qwen3_5, qwen3_next

    text = open(qwen3_next.__file__).read()
    assert "QwenGatedDeltaNetAttention(" in text
    assert "gqa_interleaved_layout=True" in text
    assert "class Qwen3NextGatedDeltaNet" not in text
    assert "HasInnerState, IsHybrid" in text
    assert read_header(Path(qwen3_next.__file__))["cpu_dtype"] == "bfloat16"
    flat = open(qwen3_5.__file__).read()
    assert "gqa_interleaved_layout=False" in flat
    assert '".linear_attn.in_proj_qkv.": (".linear_attn.in_proj_qkvz.", (0, 1, 2))' in (
        flat.replace("'", '"')
    )
    assert qwen3_5.Qwen3_5ForCausalLM.packed_modules_mapping["in_proj_ba"] == [
        "in_proj_b",
        "in_proj_a",
    ]
    from generated import olmo_hybrid

    olmo = open(olmo_hybrid.__file__).read()
    assert "self.linear_attn = OlmoHybridGatedDeltaNetOnCPU(" in olmo
    assert "self._conv_parts(weights, loaded)" in olmo
    config = _layer("qwen3_next")[2]
    for tp in (1, 2):
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(
                hf_config=config, hf_text_config=config, dtype="bfloat16"
            ),
            cache_config=SimpleNamespace(
                mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto"
            ),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
            speculative_config=None,
            num_speculative_tokens=0,
        )
        ours = qwen3_next.Qwen3NextForCausalLM
        assert ours.get_mamba_state_shape_from_config(
            vllm_config
        ) == Native.get_mamba_state_shape_from_config(vllm_config)
    assert (
        qwen3_next.Qwen3NextForCausalLM.get_mamba_state_copy_func()
        == Native.get_mamba_state_copy_func()
    )


def _verify(*args: str, code: int = 0) -> dict:
    result = run_cli("codemods.verify", *args)
    lines = result.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines else {}
    assert result.returncode == code, (out, result.stderr[-2000:])
    return out


@pytest.mark.engine
def test_qwen3_next_in_bf16_against_transformers_own_bf16_error():
    """Linear and full attention layers, MoE, 8 decode steps carrying both states, in
    bf16 (the only dtype vLLM's CPU kernels take), held to transformers' own bf16
    error on the same checkpoint."""
    out = _verify("qwen3_next")
    assert out["ok"] and out["impl"] == "generated.qwen3_next:Qwen3NextForCausalLM"
    assert out["dtype"] == "bfloat16"
    assert {"Qwen3NextGatedDeltaNet", "Qwen3NextAttention"} <= set(out["kinds"])
    assert out["max_abs_logprob_diff"] <= 2 * out["noise_floor"]
    assert out["mean_abs_logprob_diff"] <= 2 * out["noise_mean"]


@pytest.mark.engine
def test_olmo_hybrid_runs_vllms_layer_with_its_core_on_cpu_ops():
    """vLLM 0.32's OLMo Hybrid layer has Triton kernels only; the file runs vLLM's
    layer with its core on vLLM's CPU ops, in bf16, both layer kinds built, published
    q/k/v conv parts loaded into its one conv."""
    out = _verify("olmo_hybrid")
    assert out["ok"] and out["impl"] == "generated.olmo_hybrid:OlmoHybridForCausalLM"
    assert out["dtype"] == "bfloat16"
    assert {
        "OlmoHybridGatedDeltaNet",
        "OlmoHybridAttentionDecoderLayer",
        "OlmoHybridLinearAttentionDecoderLayer",
    } <= set(out["kinds"])


@pytest.mark.engine
def test_a_file_with_the_wrong_projection_layout_fails_verify(tmp_path):
    """The bf16 bound is not loose: the committed file with the layout flag flipped
    (Qwen3-Next's interleaved projections read as flat) fails it."""
    from generated import qwen3_next

    text = open(qwen3_next.__file__).read()
    assert text.count("gqa_interleaved_layout=True") == 1
    path = tmp_path / "qwen3_next.py"
    path.write_text(
        text.replace("gqa_interleaved_layout=True", "gqa_interleaved_layout=False")
    )
    out = _verify(str(path), code=1)
    assert not out["ok"]
    assert out["mean_abs_logprob_diff"] > 2 * out["noise_mean"]
