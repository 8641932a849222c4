"""Checkpoint names transformers renames at load time, for the generated loader.

transformers v5 keeps a table of renames per class or model type (its conversion
mapping): published checkpoints keep their original names (GPT-NeoX's head is saved as
`embed_out`, the modeling file names it `lm_head`). The generated model is named like
the modeling file, so its loader applies the same renames. Only plain renames are
emitted, plus one kind of converter: the stacking of per-expert tensors into a MoE
block's 3-D parameters, which vLLM's fused MoE loader does itself (it reads both
layouts); per-expert names other than vLLM's (Mixtral's w1/w3/w2) are renamed to
gate_proj/up_proj/down_proj. Any other conversion is refused (not emitted yet).
"""

from __future__ import annotations

import re

from .errors import CodemodError

# a regex that is a literal string, optionally anchored at the start; an unescaped dot
# is read as a dot (in these names it only ever stands for the separator)
_LITERAL = re.compile(r"^\^?(?:[\w\-.]|\\\.)+$")
# `<prefix>experts.*.<name>.weight`: one expert's projection in a published checkpoint
_PER_EXPERT = re.compile(r"^(?P<prefix>.*)experts\.\*\.(?P<name>\w+)\.weight$")
# vLLM's fused MoE loader reads per-expert tensors under these names, stacked ones as
# `experts.gate_up_proj` / `experts.down_proj`
VLLM_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
STACKED_PARAMS = ("gate_up_proj", "down_proj")


def _expert_stacking(conversion, stacked: tuple[str, str]) -> list[str] | None:
    """The per-expert names a converter stacks into the experts' (gate_up, down)
    parameters ([gate, up] or [down]), or None if it is not that converter."""
    operations = getattr(conversion, "operations", None) or []
    ops = [(type(o).__name__, getattr(o, "dim", None)) for o in operations]
    sources = [_PER_EXPERT.match(p) for p in conversion.source_patterns]
    if len(conversion.target_patterns) != 1 or not all(sources):
        return None
    target = conversion.target_patterns[0]
    prefix = sources[0]["prefix"]
    if len(sources) == 2 and ops == [("MergeModulelist", 0), ("Concatenate", 1)]:
        param = stacked[0]
    elif len(sources) == 1 and ops == [("MergeModulelist", 0)]:
        param = stacked[1]
    else:
        return None
    if target != f"{prefix}experts.{param}":
        return None
    return [src["name"] for src in sources]


def renames(
    causal_cls, model_type: str, stacked: tuple[str, str] | None = None
) -> dict[str, dict[str, str]]:
    """{WeightsMapper field: {old: new}}: "orig_to_new_prefix" / "orig_to_new_substr"
    for plain renames, "orig_to_new_regex" / "orig_to_new_suffix" for the names of MoE
    experts. `stacked` names the experts' (gate_up, down) parameters, if any."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    name = causal_cls.__name__
    conversions = (
        get_checkpoint_conversion_mapping(name)
        or get_checkpoint_conversion_mapping(model_type)
        or []
    )
    out: dict[str, dict[str, str]] = {}
    expert_names: list[str] = []
    for conversion in conversions:
        sources, targets = conversion.source_patterns, conversion.target_patterns
        if stacked and (names := _expert_stacking(conversion, stacked)):
            expert_names += names
            continue
        if type(conversion) is not WeightRenaming or len(sources) != 1:
            raise CodemodError(
                f"cannot generate: transformers converts {name} checkpoints with "
                f"{type(conversion).__name__} {sources} -> {targets}, not emitted yet"
            )
        source, target = sources[0], targets[0]
        if not _LITERAL.match(source):
            raise CodemodError(
                f"cannot generate: transformers renames {name} checkpoint keys by the regex {source!r}, not emitted yet"
            )
        kind = "orig_to_new_prefix" if source.startswith("^") else "orig_to_new_substr"
        literal = source.lstrip("^").replace("\\.", ".")
        out.setdefault(kind, {})[literal] = target
    if stacked:
        _expert_renames(out, expert_names, stacked, name)
    return out


def _expert_renames(
    out, names: list[str], stacked: tuple[str, str], owner: str
) -> None:
    """Per-expert names [gate, up, down] and the stacked parameter names, renamed to
    the ones vLLM's fused MoE loader reads."""
    if names and len(names) != 3:
        raise CodemodError(
            f"cannot generate: transformers stacks {owner} experts from {names}, expected gate, up and down"
        )
    for old, new in zip(names, VLLM_EXPERT_NAMES):
        if old != new:
            pattern = rf"\.experts\.(\d+)\.{old}\."
            out.setdefault("orig_to_new_regex", {})[pattern] = rf".experts.\1.{new}."
    for old, new in zip(stacked, STACKED_PARAMS):
        if old != new:
            out.setdefault("orig_to_new_suffix", {})[
                f".experts.{old}"
            ] = f".experts.{new}"
