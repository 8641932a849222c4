"""The RMSNorm pattern on real transformers norm classes: which of vLLM's norm forms the
proof finds each computes, and what the generated construction builds. Engine-free: the
classes are built directly; the committed files they reach run in vLLM elsewhere
(coverage, the faithful engine tests)."""

from __future__ import annotations

import importlib

import libcst as cst
import pytest
import torch

from conftest import edited_modeling_file

from codemods.loading import load_module
from codemods.source import load
from fusion_patterns import rms_norm
from fusion_patterns.base import Refusal


@pytest.fixture(autouse=True)
def vllm_config():
    """vLLM's norms read the current config when built."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        yield


def _spec_and_class(source: str, cls: str):
    found = rms_norm.match(load(source).classes[cls])
    module = importlib.import_module(
        f"transformers.models.{source.removeprefix('modeling_').removesuffix('.py')}."
        f"{source.removesuffix('.py')}"
    )
    return found, getattr(module, cls)


def _built(construction: str, dtype: torch.dtype, eps: float = 1e-6):
    """What the generated file's construction builds, under the model's dtype."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(dtype):
        return eval(  # noqa: S307 - the toolkit's own emitted expression
            construction,
            {"RMSNorm": RMSNorm, "GemmaRMSNorm": GemmaRMSNorm, "torch": torch},
            {"config": type("C", (), {"rms_norm_eps": eps}), "size": 64},
        )


def _call(text: str) -> cst.Call:
    return cst.parse_expression(text)


def _random(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(
                1
                + 0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3))
            )
    return module


def test_weight_before_the_cast_is_vllms_norm_with_an_fp32_weight():
    """OLMo 2 multiplies by the weight in fp32 and casts after: vLLM's RMSNorm with an
    fp32 weight gives its bf16 bits exactly; vLLM's usual (bf16-weight) norm does not.
    """
    spec, cls = _spec_and_class("modeling_olmo2.py", "Olmo2RMSNorm")
    proven = rms_norm.prove(spec, [_random(cls(64, eps=1e-6))])
    assert proven.form == rms_norm.FP32_WEIGHT
    text = proven.construction(_call("Olmo2RMSNorm(size, eps=config.rms_norm_eps)"))
    assert text == "RMSNorm(size, eps=config.rms_norm_eps, dtype=torch.float32)"

    theirs = _random(cls(64, eps=1e-6)).to(torch.bfloat16)
    ours = _built(text, torch.bfloat16)
    assert ours.weight.dtype == torch.float32
    ours.weight.data.copy_(theirs.weight)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).to(
        torch.bfloat16
    )
    with torch.no_grad():
        want = theirs(x)
        assert torch.equal(ours.forward_native(x), want)
        usual = _built("RMSNorm(size, eps=1e-6)", torch.bfloat16)
        usual.weight.data.copy_(theirs.weight)
        assert not torch.equal(usual.forward_native(x), want)


def test_the_llama_form_keeps_the_weight_in_the_models_dtype():
    spec, cls = _spec_and_class("modeling_qwen3.py", "Qwen3RMSNorm")
    proven = rms_norm.prove(spec, [_random(cls(64, eps=1e-6))])
    assert proven.form == rms_norm.AFTER_CAST
    text = proven.construction(_call("Qwen3RMSNorm(size, eps=config.rms_norm_eps)"))
    assert text == "RMSNorm(size, eps=config.rms_norm_eps)"


def test_a_norm_without_a_weight_is_vllms_weightless_norm():
    spec, cls = _spec_and_class("modeling_nanochat.py", "NanoChatRMSNorm")
    assert spec.size_param is None
    proven = rms_norm.prove(spec, [cls(eps=1e-6)])
    text = proven.construction(_call("NanoChatRMSNorm(eps=config.rms_norm_eps)"))
    assert text == "RMSNorm(0, eps=config.rms_norm_eps, has_weight=False)"
    theirs, ours = cls(eps=0.3), _built(text, torch.float32, eps=0.3)
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(ours.forward_native(x), theirs(x), rtol=1e-6, atol=1e-6)


def test_a_weight_built_under_an_argument_follows_each_construction():
    """Gemma 4's norm builds its weight under `with_scale` and roots with
    `torch.pow(v, -0.5)`: a construction with `with_scale=False` is weightless, the
    others keep the (fp32) weight."""
    spec, cls = _spec_and_class("modeling_gemma4_unified.py", "Gemma4UnifiedRMSNorm")
    assert (spec.weight_switch, spec.weight_switch_default) == ("with_scale", True)
    proven = rms_norm.prove(
        spec, [_random(cls(64, eps=1e-6)), cls(64, eps=1e-6, with_scale=False)]
    )
    assert proven.form == rms_norm.FP32_WEIGHT
    assert proven.construction(
        _call(
            "Gemma4UnifiedRMSNorm(self.head_dim, eps=config.rms_norm_eps, with_scale=False)"
        )
    ) == ("RMSNorm(0, eps=config.rms_norm_eps, has_weight=False)")
    assert proven.construction(
        _call("Gemma4UnifiedRMSNorm(dim=self.head_dim, eps=config.rms_norm_eps)")
    ) == ("RMSNorm(self.head_dim, eps=config.rms_norm_eps, dtype=torch.float32)")
    with pytest.raises(rms_norm.PatternRefused, match="not a literal"):
        proven.construction(_call("Gemma4UnifiedRMSNorm(8, with_scale=flag)"))


def test_a_norm_none_of_vllms_forms_computes_is_refused(tmp_path):
    """A Qwen3 norm that rounds to bf16 before the weight, even in an fp32 model."""
    path = edited_modeling_file(
        tmp_path,
        "modeling_qwen3.py",
        "return self.weight * hidden_states.to(input_dtype)",
        "return self.weight * hidden_states.to(torch.bfloat16).to(input_dtype)",
    )
    source = load(str(path))
    spec = rms_norm.match(source.classes["Qwen3RMSNorm"])
    pymodule = load_module(source, trust_remote_code=True)
    module = _random(pymodule.Qwen3RMSNorm(64, eps=1e-6))
    with pytest.raises(rms_norm.PatternRefused, match="none of vLLM's RMSNorm forms"):
        rms_norm.prove(spec, [module])


def test_a_matrix_weight_is_refused_with_its_reason():
    """Cohere's per-head LayerNorm holds a [heads, dim] weight."""
    spec, cls = _spec_and_class("modeling_cohere.py", "CohereLayerNorm")
    if isinstance(spec, Refusal):
        pytest.fail(spec.reason)
    with pytest.raises(rms_norm.PatternRefused, match="2-D"):
        rms_norm.prove(spec, [cls((4, 64), eps=1e-5)])


def test_a_norm_only_another_tiny_config_builds_is_fused_too():
    """Cohere2-MoE builds an RMSNorm or a LayerNorm by `rms_norm_eps`: the probe's tiny
    model builds the LayerNorm, so the RMSNorm is built alone and proven (verify runs
    both configs), not copied unclaimed; the committed file is current (test_check)."""
    from conftest import REPO

    text = (REPO / "generated" / "cohere2_moe.py").read_text()
    assert (
        "Fused: input_layernorm (Cohere2MoeDecoderLayer) -> input_layernorm (RMSNorm)"
        in text
    )
    assert "class Cohere2MoeRMSNorm" not in text  # vLLM's norm in its place
    assert "class Cohere2MoeLayerNorm" in text  # the other branch, as the source has it
