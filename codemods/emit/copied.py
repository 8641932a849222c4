"""Source classes copied as they are: norms the toolkit could not prove equal to a vLLM
norm. They are plain torch (no sharded state), so the copy computes exactly what the
source computes; decorators (hub-kernel hooks) are dropped."""

from __future__ import annotations

from fusion_patterns.base import code

from ..structure import ModelStructure


def copied_norm_classes(s: ModelStructure) -> list[str]:
    """Unproven norm classes some emitted module builds, in source order."""
    used = set()
    for owner in (s.layer, s.base, s.classes[s.attention.class_name]):
        used |= set(s.norm_attrs(owner, proven_only=False).values())
    return [name for name in s.classes if name in used and name not in s.norms]


def emit(s: ModelStructure) -> list[str]:
    out = []
    for name in copied_norm_classes(s):
        node = s.classes[name].node.with_changes(decorators=[])
        out.append(
            f"# Copied from {s.source.display}: not proven equal to a vLLM norm (see the report)\n"
            + code(node)
        )
    return out
