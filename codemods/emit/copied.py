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


def functions(s: ModelStructure, body: str) -> list[str]:
    """Module-level functions of the source the emitted code calls (DeepSeek's
    `yarn_apply_mscale` in a kept `self.scaling = ...`), with the ones they call."""
    import re

    import libcst as cst

    defined = {
        n.name.value: n for n in s.source.module.body if isinstance(n, cst.FunctionDef)
    }
    wanted: list[str] = []
    pending = [body]
    while pending:
        text = pending.pop()
        for name in defined:
            if name not in wanted and re.search(rf"\b{name}\(", text):
                wanted.append(name)
                pending.append(code(defined[name]))
    return [
        f"# Copied from {s.source.display}\n"
        + code(defined[n].with_changes(decorators=[]))
        for n in defined
        if n in wanted
    ]
