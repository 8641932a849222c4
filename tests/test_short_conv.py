"""LFM2's gated short convolutions read as vLLM's ShortConv and proven against its
computation over a prefill and decode steps with the conv state carried; copies of the
source with one thing wrong are refused with the step that differs (engine-free; the
engine runs are at the end, marked)."""

from __future__ import annotations

import glob
import importlib
import json
import os

import pytest

from conftest import edited_modeling_file, run_cli

from codemods.loading import load_module
from codemods.source import load
from fusion_patterns.base import PatternRefused, code
from fusion_patterns.short_conv import ShortConvSpec, match, prove

BLOCKS = {"lfm2": "Lfm2ShortConv", "lfm2_moe": "Lfm2MoeShortConv"}
CONFIGS = {"lfm2": "Lfm2Config", "lfm2_moe": "Lfm2MoeConfig"}


def _block(name: str, path=None, **extra):
    source = load(str(path) if path else f"modeling_{name}.py")
    module = load_module(source, trust_remote_code=path is not None)
    config = getattr(
        importlib.import_module(f"transformers.models.{name}"), CONFIGS[name]
    )
    config = config(
        hidden_size=48,
        num_hidden_layers=2,
        vocab_size=128,
        layer_types=["conv", "full_attention"],
        **extra,
    )
    cls = BLOCKS[name]
    return source.classes[cls], getattr(module, cls)(config, layer_idx=0), config


def test_the_two_short_convolutions_and_nothing_else_are_read_as_shortconv():
    import transformers

    models = os.path.join(os.path.dirname(transformers.__file__), "models")
    found = {}
    for path in sorted(glob.glob(os.path.join(models, "*", "modeling_*.py"))):
        text = open(path).read()
        if "Conv1d" not in text or "chunk(3" not in text:
            continue  # a candidate builds one and splits its projection in three
        try:
            source = load(os.path.basename(path))
        except Exception:  # noqa: BLE001 - a file the toolkit cannot read: no candidate
            continue
        for name, info in source.classes.items():
            if (spec := match(info)) is not None:
                found[name] = spec
    assert sorted(found) == sorted(BLOCKS.values())
    assert all(isinstance(spec, ShortConvSpec) for spec in found.values())


def test_the_arguments_are_the_sources_own_expressions():
    spec = match(_block("lfm2")[0])
    assert (spec.in_proj, spec.conv, spec.out_proj) == ("in_proj", "conv", "out_proj")
    assert code(spec.dim) == "config.hidden_size"
    assert code(spec.kernel) == "config.conv_L_cache"
    assert code(spec.bias) == "config.conv_bias"


@pytest.mark.parametrize("name", sorted(BLOCKS))
@pytest.mark.parametrize("bias", [False, True])
def test_a_short_convolution_equals_vllms_over_prefill_and_decode_steps(name, bias):
    info, module, config = _block(name, conv_bias=bias, conv_L_cache=4)
    prove(match(info), module, config)


# (what is wrong, old text, new text, what the proof says differs)
EDITS = {
    "the kernel's window off by one": (
        "    padding = weight.shape[-1] - 1\n",
        "    padding = weight.shape[-1]\n",
        "the conv over the prompt",
    ),
    "the C gate dropped": (
        "        y = C * hidden_states\n",
        "        y = hidden_states\n",
        "the conv over the prompt",
    ),
    "the conv state reset between decode steps": (
        "            conv_state = past_key_values.layers[self.layer_idx].conv_states[0]\n",
        "            conv_state = torch.zeros_like(past_key_values.layers[self.layer_idx].conv_states[0])\n",
        "decode step 1",
    ),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_short_convolution_is_refused(tmp_path, edit):
    old, new, reason = EDITS[edit]
    path = edited_modeling_file(tmp_path, "modeling_lfm2.py", old, new)
    info, module, config = _block("lfm2", path=path)
    with pytest.raises(PatternRefused, match=reason):
        prove(match(info), module, config)


def test_an_edited_lfm2_is_not_generated(tmp_path):
    """Through the command: the refused block is named with its reason, nothing is
    written and the exit is non-zero."""
    old, new, _ = EDITS["the conv state reset between decode steps"]
    path = edited_modeling_file(tmp_path, "modeling_lfm2.py", old, new)
    out = tmp_path / "out"
    result = run_cli(
        "codemods.apply", str(path), "--trust-remote-code", "--out", str(out)
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: cannot generate: Lfm2ShortConv"
    )
    assert "not proven (decode step 1 (conv state carried)" in lines[0]
    assert not out.exists() or not list(out.iterdir())


def test_the_generated_lfm2_builds_vllms_shortconv_and_its_state_cache():
    """The committed file: the block is vLLM's layer under the checkpoint's names, the
    causal LM a hybrid whose state shape is vLLM's own lfm2.py's on the same config."""
    from types import SimpleNamespace

    from vllm.model_executor.models.lfm2 import Lfm2ForCausalLM as Native

    from generated import lfm2

    text = open(lfm2.__file__).read()
    assert "self.conv = ShortConv(" in text and "class Lfm2ShortConv" not in text
    assert "HasInnerState, IsHybrid" in text
    config = _block("lfm2")[2]
    config.conv_dim = config.hidden_size  # the field vLLM's own file reads
    for tp in (1, 2):
        vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(hf_config=config, hf_text_config=config),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp),
            num_speculative_tokens=0,
        )
        ours = lfm2.Lfm2ForCausalLM.get_mamba_state_shape_from_config(vllm_config)
        assert ours == Native.get_mamba_state_shape_from_config(vllm_config)
    assert (
        lfm2.Lfm2ForCausalLM.get_mamba_state_copy_func()
        == Native.get_mamba_state_copy_func()
    )


def _verify(*args: str) -> dict:
    result = run_cli("codemods.verify", *args)
    lines = result.stdout.strip().splitlines()
    out = json.loads(lines[-1]) if lines else {}
    assert result.returncode == 0, (out, result.stderr[-2000:])
    return out


@pytest.mark.engine
def test_lfm2_over_two_ranks():
    """Conv and attention layers (a mixed `layer_types`), 8 decode steps carrying the
    conv state, the block's width split over two ranks."""
    out = _verify("lfm2", "--tp", "2")
    assert out["ok"] and out["impl"] == "generated.lfm2:Lfm2ForCausalLM", out
    assert out["tokens_equal"] and out["max_abs_logprob_diff"] <= 1e-4
    assert {"Lfm2ShortConv", "Lfm2Attention"} <= set(out["kinds"])
    assert "mixed_layer_types" in out["features"]
    assert out["rank_share"] <= 0.6, out
