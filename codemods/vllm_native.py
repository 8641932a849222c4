"""What vLLM itself serves an architecture with, read from vLLM's own registry and
modules: its native class and the state layers that class's module builds (vLLM's
`MambaBase` layers: Mamba, gated DeltaNet, KDA, short convolutions, ...).

A layer no pattern maps is then said for what it is: "refused" where vLLM has a class
for the architecture (the toolkit could map onto vLLM's layer and does not yet, and the
row names that layer), "out of scope" where vLLM has none (nothing in vLLM computes it).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Native:
    module: str  # where vLLM's class for the architecture lives
    state_layers: tuple[str, ...]  # the state layers that module builds


def native(arch: str) -> Native | None:
    """vLLM's class for `arch` and its state layers, or None where vLLM registers no
    class for it (or its module cannot be imported here)."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    entry = _VLLM_MODELS.get(arch)
    if entry is None:
        return None
    module, cls = entry
    name = module if "." in module else f"vllm.model_executor.models.{module}"
    try:
        from vllm.model_executor.layers.mamba.abstract import MambaBase

        found = getattr(importlib.import_module(name), cls)
    except Exception:  # noqa: BLE001 - a module this build cannot import: unknown
        return None
    where = sys.modules[found.__module__]
    layers = sorted(
        v.__name__
        for v in vars(where).values()
        if inspect.isclass(v) and issubclass(v, MambaBase) and v is not MambaBase
    )
    return Native(found.__module__, tuple(layers))


def unmapped(arch: str, what: str, kind: str = "", mapped: str = "") -> str:
    """The one-line error for a part of `arch` that is not attention as vLLM's
    Attention takes it (`what` says which and why) and that no pattern maps (`kind`:
    the class; `mapped`: what the patterns do map)."""
    maps = f" (mapped: {mapped})" if mapped else ""
    found = native(arch)
    if found is None:
        return f"out of scope: {what}; vLLM has no class for {arch} either" + (
            f", and no pattern maps {kind} onto a vLLM layer{maps}" if kind else ""
        )
    return (
        f"cannot generate: {what}; {serves(found, arch)}, and no pattern maps "
        f"{kind or 'it'} onto it yet{maps}"
    )


def serves(found: Native | None, arch: str) -> str:
    """ "vLLM serves <arch> with its own <module> (its state layers: ...)", or ""."""
    if found is None:
        return ""
    layers = (
        f" (its state layers: {', '.join(found.state_layers)})"
        if found.state_layers
        else ""
    )
    return f"vLLM serves {arch} with its own {found.module}{layers}"
