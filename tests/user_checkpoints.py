"""What users put on top of a model, made by hand from a tiny checkpoint (no downloads):
a compressed-tensors W8A8 int8 checkpoint and a PEFT LoRA adapter, each with the
transformers model that computes what vLLM should compute from it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

INT8_MAX = 127
# Weights are quantized to [-63, 63] (7 bits, still stored as int8): vLLM's CPU int8
# GEMM (oneDNN) on x86 without VNNI (AVX2 only, as on these machines) adds pairs of
# u8 x s8 products in saturating int16, so full-range weights give wrong sums there
# (measured: 70 of 320 output columns of one o_proj off by up to 10%, with vLLM's own
# RowParallelLinear); with 7-bit weights a pair cannot saturate and the layer matches
# its dequantized weights to 1e-6.
WEIGHT_LEVELS = 63
LORA_RANK = 8  # the smallest max_lora_rank vLLM accepts


def w8a8_config(targets: list[list[str]], ignore: list[str] = ()) -> dict:
    """compressed-tensors `quantization_config`: one group per target list, each with
    int8 per-channel symmetric weights and dynamic per-token symmetric activations."""
    scheme = {
        "weights": {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "channel",
            "dynamic": False,
        },
        "input_activations": {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "token",
            "dynamic": True,
        },
        "output_activations": None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            f"group_{i}": {"targets": group, **scheme}
            for i, group in enumerate(targets)
        },
        "ignore": ["lm_head", *ignore],
    }


def module_matches(name: str, targets: list[str]) -> bool:
    return any(
        re.match(t[3:], name) if t.startswith("re:") else name == t for t in targets
    )


def quantize_w8a8(
    src: Path,
    dst: Path,
    targets: list[list[str]],
    ignore: list[str] = (),
    levels: int = INT8_MAX,
) -> dict[str, torch.Tensor]:
    """Copy the checkpoint at `src` to `dst` with every 2-D `<module>.weight` whose module
    matches a target stored as int8 with a per-output-channel `weight_scale`; returns the
    dequantized weights {tensor name: fp32 tensor} (what the int8 values stand for)."""
    shutil.copytree(src, dst)
    flat = [t for group in targets for t in group]
    tensors = load_file(dst / "model.safetensors")
    out, dequantized = {}, {}
    for name, w in tensors.items():
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if (
            module is None
            or w.dim() != 2
            or not module_matches(module, flat)
            or module_matches(module, list(ignore))
        ):
            out[name] = w
            continue
        scale = (w.abs().amax(dim=1, keepdim=True) / levels).clamp(min=1e-12)
        q = torch.round(w / scale).clamp(-levels, levels).to(torch.int8)
        out[name] = q.contiguous()
        out[f"{module}.weight_scale"] = scale.to(torch.float32).contiguous()
        dequantized[name] = q.to(torch.float32) * scale
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = w8a8_config(targets, ignore)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic per-token symmetric int8, as vLLM quantizes a W8A8 layer's input."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=1e-12)
    return torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX) * scale


def w8a8_reference(model: torch.nn.Module, dequantized: dict[str, torch.Tensor]):
    """`model` with the dequantized weights and its quantized linears' inputs quantized
    per token: the function a W8A8 engine computes, in fp32 transformers."""
    state = model.state_dict()
    for name, w in dequantized.items():
        state[name].copy_(w)
    quantized = {name[: -len(".weight")] for name in dequantized}
    for name, module in model.named_modules():
        if name in quantized:
            module.register_forward_pre_hook(
                lambda _m, args: (fake_quantize_per_token(args[0]), *args[1:])
            )
    return model


def make_lora_adapter(
    model: torch.nn.Module,
    dst: Path,
    targets: list[str],
    rank: int = LORA_RANK,
    alpha: int = 8,
) -> None:
    """A PEFT adapter on every linear named in `targets` (random A and B, B not zero, so
    the adapter changes the output), written as PEFT writes it; `model` gets the adapter
    merged into its weights (W + alpha / rank * B @ A)."""
    gen = torch.Generator().manual_seed(1234)
    tensors = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in targets or not isinstance(
            module, torch.nn.Linear
        ):
            continue
        a = torch.randn(rank, module.in_features, generator=gen) * 0.2
        b = torch.randn(module.out_features, rank, generator=gen) * 0.2
        tensors[f"base_model.model.{name}.lora_A.weight"] = a
        tensors[f"base_model.model.{name}.lora_B.weight"] = b
        with torch.no_grad():
            module.weight += (alpha / rank) * (b @ a)
    assert tensors, f"no linear named {targets}"
    dst.mkdir(parents=True)
    save_file(tensors, dst / "adapter_model.safetensors", metadata={"format": "pt"})
    (dst / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": rank,
                "lora_alpha": alpha,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": sorted(targets),
                "fan_in_fan_out": False,
                "use_rslora": False,
                "modules_to_save": None,
                "base_model_name_or_path": None,
            },
            indent=2,
        )
    )
