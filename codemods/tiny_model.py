"""Building and running a tiny model of a source: whether a set of config values
builds a small model that runs in transformers, and random weights that make every
parameter matter. Below both `tiny` (which picks the values) and `length_regimes`
(which moves lengths inside the prompts)."""

from __future__ import annotations

import torch

VOCAB = 512  # the tiny vocabulary


def _same_under_sdpa(model, config, ids, eager) -> None:
    """A feature under which the source's own eager and sdpa attention disagree (Falcon's
    ALiBi is added twice on its eager path) is not one transformers serves consistently:
    raise, so the next variant (with a feature off) is tried."""
    if not getattr(type(model), "_supports_sdpa", False):
        return
    try:
        config._attn_implementation = "sdpa"
        with torch.no_grad():
            sdpa = model(input_ids=ids, use_cache=False).logits
    except Exception:  # noqa: BLE001 - no sdpa path: nothing to compare
        return
    finally:
        config._attn_implementation = "eager"
    scale = eager.abs().max().item() or 1.0
    if (sdpa - eager).abs().max().item() / scale > 1e-4:
        raise ValueError("the source's eager and sdpa attention disagree")


# A tiny model has at most tens of millions of parameters (a vocabulary or experts the
# rules keep); a sub-config they do not shrink (BLT: 4.6 billion) would take hours.
MAX_TINY_PARAMETERS = 200_000_000


def _small_enough(causal_cls, config) -> None:
    """Raise if the tiny config still builds a large model (counted on the meta device,
    where building costs nothing)."""
    try:
        with torch.device("meta"):
            sizes = {n: p.numel() for n, p in causal_cls(config).named_parameters()}
    except Exception:  # noqa: BLE001 - cannot build on meta: the real build decides
        return
    size = sum(sizes.values())
    if size > MAX_TINY_PARAMETERS:
        largest = max(sizes, key=sizes.get)
        raise ValueError(
            f"the tiny config still builds {size / 1e6:.0f}M parameters, "
            f"{sizes[largest] / 1e6:.0f}M of them in {largest} "
            "(a size field the tiny rules do not shrink)"
        )


def check_runs(causal_cls, values: dict) -> None:
    """Raise unless `values` build a small model that runs a forward in transformers
    (and its eager and sdpa attention agree)."""
    config = causal_cls.config_class(**values)
    config._attn_implementation = "eager"
    _small_enough(causal_cls, config)
    torch.manual_seed(0)
    model = causal_cls(config).float().eval()
    ids = (torch.arange(7)[None] * 37) % VOCAB
    with torch.no_grad():
        eager = model(input_ids=ids, use_cache=False).logits
    _same_under_sdpa(model, config, ids, eager)


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
    saved = set(model.state_dict())
    for name, buffer in sorted(model.named_buffers()):
        # a saved bias buffer (a router's score correction bias) moves the routing
        if name in saved and "bias" in name and buffer.is_floating_point():
            buffer.copy_(0.05 * torch.randn(buffer.shape, generator=gen))
