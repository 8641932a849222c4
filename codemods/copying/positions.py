"""Positions a copied class derives from the cache instead of receiving them.

transformers' modules may count positions from the cache they are handed
(`past_seen_tokens = past_key_values.get_seq_length(...)`, then `torch.arange(n) +
past_seen_tokens`: Llama 4's attention temperature). vLLM hands a module no such cache:
the faithful copy folds the length to 0, so on every decode step those positions would
restart at 0. A copy in which such a name is still used is refused with the reason.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo
from fusion_patterns.cache_positions import cache_length_names as method_cache_lengths


def cache_length_names(info: ClassInfo) -> dict[str, str]:
    """{name: its assignment} for the names a method of `info` sets from the cache's
    length (outside __init__)."""
    out = {}
    for method in info.node.body.body:
        if isinstance(method, cst.FunctionDef) and method.name.value != "__init__":
            out.update(method_cache_lengths(method))
    return out


def still_used(info: ClassInfo, emitted: str) -> str | None:
    """The source assignment behind a cache-length name the emitted class still reads,
    or None."""
    names = cache_length_names(info)
    if not names:
        return None
    module = cst.parse_module(emitted)
    stored = {
        t.target.value
        for a in m.findall(module, m.Assign())
        for t in a.targets
        if isinstance(t.target, cst.Name)
    }
    reads = [n.value for n in m.findall(module, m.Name()) if n.value in names]
    for name in names:
        if reads.count(name) > (1 if name in stored else 0):
            return names[name]
    return None


# the names vLLM's positions go by in an emitted forward
POSITION_NAMES = {"position_ids", "positions", "cache_position"}


def handed_without_positions(info: ClassInfo, emitted: str) -> str | None:
    """The assignment behind a cache-length name the emitted forward hands a module
    that receives none of vLLM's positions (TrOCR's decoder: `self.embed_positions(input_ids,
    past_key_values_length=...)`, which counts positions from it), or None. A call
    that gets the positions too (OPT's, XGLM's embeddings) uses the length only where
    none are given, or to size a table. (A length that only sizes a tensor, Falcon's ALiBi
    mask, is left alone.)"""
    names = cache_length_names(info)
    if not names:
        return None
    module_call = m.Call(func=m.Attribute(value=m.Name("self")))
    for call in m.findall(cst.parse_module(emitted), module_call):
        read = {n.value for a in call.args for n in m.findall(a.value, m.Name())}
        handed = [n for n in names if n in read]
        if handed and not read & POSITION_NAMES:
            return names[handed[0]]
    return None


def refuse_if_still_used(info: ClassInfo, emitted: str, base: bool = False) -> None:
    """Raise where the emitted class still reads a cache-length name (`base`: where the
    base model's forward hands one to a call without vLLM's positions)."""
    from ..errors import CodemodError

    found = (handed_without_positions if base else still_used)(info, emitted)
    if found is not None:
        raise CodemodError(
            f"cannot generate: {info.name} counts positions from the cache's length "
            f"(`{' '.join(found.split())}`), which vLLM hands no module: under vLLM "
            "they would restart at 0 on every decode step"
        )
