"""What vLLM itself serves an architecture with, read from vLLM's own registry and
modules: its native class and the state layers that class's module builds (vLLM's
`MambaBase` layers: Mamba, gated DeltaNet, KDA, short convolutions, ...).

A layer no pattern maps is then said for what it is: "refused" where vLLM has a class
for the architecture (the toolkit could map onto vLLM's layer and does not yet, and the
row names that layer), "out of scope" where vLLM has none (nothing in vLLM computes it).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Native:
    module: str  # where vLLM's class for the architecture lives
    state_layers: tuple[str, ...]  # the state layers that module builds


TRANSFORMERS_BACKEND = "vllm.model_executor.models.transformers"


def native_class(arch: str) -> type | None:
    """vLLM's own class for `arch`, or None when vLLM serves that architecture only
    through the Transformers backend (or not at all)."""
    from vllm import ModelRegistry

    entry = ModelRegistry.models.get(arch)
    module = getattr(entry, "module_name", "")
    if not module.startswith("vllm.") or module.startswith(TRANSFORMERS_BACKEND):
        return None
    return entry.load_model_cls()


def native(arch: str) -> Native | None:
    """vLLM's class for `arch` and its state layers, or None where vLLM has no class
    of its own for it (or its module cannot be imported here)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    try:
        found = native_class(arch)
    except Exception:  # noqa: BLE001 - a module this build cannot import: unknown
        return None
    if found is None:
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
