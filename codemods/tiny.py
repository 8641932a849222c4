"""Tiny random-weight checkpoints built from a model's own config class.

Sizes are shrunk so the model runs on a CPU in seconds (a head size vLLM's CPU attention
supports, GQA, several layers); features the config offers are switched on with values
that make a difference: every bias flag, sliding-window layers mixed with full ones and a
window shorter than the prompts, and norm weights and biases that are not ones and zeros.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Sizes: applied to whichever of these fields the config class has.
TINY_SIZES = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
}
# Features: switched on where the config class has the field.
TINY_FEATURES = {
    "attention_bias": True,
    "mlp_bias": True,
    "use_sliding_window": True,
    "sliding_window": 8,
    "max_window_layers": 2,  # layers >= 2 slide, layers < 2 attend fully
}


def tiny_config(config_cls, overrides: dict | None = None):
    fields = config_cls().to_dict()
    values = {k: v for k, v in {**TINY_SIZES, **TINY_FEATURES}.items() if k in fields}
    values.update(overrides or {})
    config = config_cls(**values)
    return config


def features_on(config) -> list[str]:
    """The feature flags and values of `config` that differ from a plain model."""
    on = []
    for key in TINY_FEATURES:
        value = getattr(config, key, None)
        if value not in (None, False):
            on.append(key if value is True else f"{key}={value}")
    layer_types = getattr(config, "layer_types", None)
    if layer_types and len(set(layer_types)) > 1:
        on.append("mixed_layer_types")
    if getattr(config, "tie_word_embeddings", False):
        on.append("tie_word_embeddings")
    return on


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights everywhere, norm weights around 1 and biases non-zero, so a dropped
    bias or a norm weight read wrong changes the output."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
        if param.ndim == 1 and "norm" in name and name.endswith("weight"):
            param.copy_(1.0 + 0.2 * noise)
        elif param.ndim == 1:
            param.copy_(0.05 * noise)
        else:
            param.copy_(noise / param.shape[-1] ** 0.5)


def build_checkpoint(causal_cls, config, out_dir: Path, seed: int = 0) -> torch.nn.Module:
    """Save a random-weight fp32 safetensors checkpoint of `causal_cls` to `out_dir`."""
    torch.manual_seed(seed)
    config.architectures = [causal_cls.__name__]
    config.torch_dtype = "float32"
    model = causal_cls(config).to(torch.float32).eval()
    randomize(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)
    # transformers may write `dtype`; vLLM reads either
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg.setdefault("torch_dtype", "float32")
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return model
