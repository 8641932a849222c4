"""Checkpoint names: transformers' own conversions, applied by the generated loader as
transformers applies them at load (the one place they are read).

Published checkpoints keep their original names; transformers renames them at load
(`WeightRenaming`, used as is: vLLM's `WeightsMapper` takes transformers' objects) and
stacks per-expert tensors into a MoE block's 3-D parameters (`WeightConverter` with
`MergeModulelist` and `Concatenate`). Copied experts keep the source's stacked
parameters, so the generated loader writes each per-expert tensor into its slice;
experts a pattern fused into vLLM's MoE layer read per-expert tensors themselves, under
vLLM's names (gate_proj / up_proj / down_proj), to which the checkpoint's are renamed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import CodemodError


@dataclass(frozen=True)
class Stacking:
    """Per-expert tensors `<prefix><sources[j] with * = e>` -> slice j of expert e of
    `<prefix><target>` (concatenated along dim `dim` of one expert's slice)."""

    sources: tuple[str, ...]
    target: str
    dim: int  # within one expert's slice


def _glob_regex(pattern: str) -> str:
    return "^(.*?)" + re.escape(pattern).replace(r"\*", r"(\d+)") + "$"


# vLLM's fused MoE loader reads per-expert tensors under these names, stacked ones as
# `experts.gate_up_proj` / `experts.down_proj`
VLLM_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
VLLM_STACKED = ("gate_up_proj", "down_proj")


def conversions(causal_cls, model_type: str, fused_experts=()):
    """(renames as WeightRenaming constructor arguments, expert stackings, {WeightsMapper
    field: {old: new}} for the names of fused experts). `fused_experts`: the (gate_up,
    down) parameter names of the experts a pattern fused."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    found = (
        get_checkpoint_conversion_mapping(causal_cls.__name__)
        or get_checkpoint_conversion_mapping(model_type)
        or []
    )
    renames: list[tuple[list[str], list[str]]] = []
    stacking: list[Stacking] = []
    fused: dict[str, dict[str, str]] = {}
    per_expert: list[str] = []
    for conv in found:
        sources = list(conv.source_patterns)
        targets = list(conv.target_patterns)
        # a renaming (PrefixChange too: a renaming by regexes it builds itself)
        if isinstance(conv, WeightRenaming) and not isinstance(conv, WeightConverter):
            renames.append((sources, targets))
            continue
        if isinstance(conv, WeightConverter):
            ops = [(type(o).__name__, getattr(o, "dim", None)) for o in conv.operations]
            names = _fused_expert_sources(sources, targets, ops, fused_experts)
            if names is not None:
                per_expert += names
                continue
            if ops == [("Concatenate", 0)] and len(targets) == 1 and _plain(sources):
                # a linear attention's conv published as q/k/v parts (OLMo Hybrid's,
                # Kimi's): the gated-DeltaNet claim's loader joins them (a layer no
                # pattern claims is refused before its weights matter)
                continue
            if len(targets) == 1 and all("*" in s for s in sources):
                if ops == [("MergeModulelist", 0)] and len(sources) == 1:
                    stacking.append(Stacking(tuple(sources), targets[0], 0))
                    continue
                if ops == [("MergeModulelist", 0), ("Concatenate", 1)]:
                    stacking.append(Stacking(tuple(sources), targets[0], 0))
                    continue
            raise CodemodError(
                f"cannot generate: transformers converts {causal_cls.__name__} checkpoints "
                f"with {[o[0] for o in ops]} {sources} -> {targets}, not emitted yet"
            )
        raise CodemodError(
            f"cannot generate: transformers converts {causal_cls.__name__} checkpoints with "
            f"{type(conv).__name__}, not emitted yet"
        )
    for stacked in fused_experts:
        _expert_renames(fused, per_expert, stacked, causal_cls.__name__)
    return renames, stacking, fused


def _plain(patterns: list[str]) -> bool:
    """Names, not patterns (no wildcard or regex syntax)."""
    return all(re.fullmatch(r"[\w.]+", p) for p in patterns)


# `<prefix>experts.*.<name>.weight`: one expert's projection in a published checkpoint
_PER_EXPERT = re.compile(r"^(?P<prefix>.*)experts\.\*\.(?P<name>\w+)\.weight$")


def _fused_expert_sources(sources, targets, ops, fused_experts) -> list[str] | None:
    """The per-expert names a converter stacks into fused experts' (gate_up, down)
    parameters ([gate, up] or [down]), or None if it stacks other ones."""
    found = [_PER_EXPERT.match(p) for p in sources]
    if len(targets) != 1 or not all(found):
        return None
    prefix = found[0]["prefix"]
    for gate_up, down in fused_experts:
        if len(found) == 2 and ops == [("MergeModulelist", 0), ("Concatenate", 1)]:
            param = gate_up
        elif len(found) == 1 and ops == [("MergeModulelist", 0)]:
            param = down
        else:
            continue
        if targets[0] == f"{prefix}experts.{param}":
            return [f["name"] for f in found]
    return None


def _expert_renames(out, names: list[str], stacked: tuple[str, str], owner: str):
    """Per-expert names [gate, up, down] and the stacked parameter names, renamed to the
    ones vLLM's fused MoE loader reads."""
    if names and len(names) != 3:
        raise CodemodError(
            f"cannot generate: transformers stacks {owner} experts from {names}, expected gate, up and down"
        )
    for old, new in zip(names, VLLM_EXPERT_NAMES):
        if old != new:
            pattern = rf"\.experts\.(\d+)\.{old}\."
            out.setdefault("orig_to_new_regex", {})[pattern] = rf".experts.\1.{new}."
    for old, new in zip(stacked, VLLM_STACKED):
        if old != new:
            out.setdefault("orig_to_new_suffix", {})[
                f".experts.{old}"
            ] = f".experts.{new}"


STACK_METHOD = """
    # per-expert checkpoint tensors -> the stacked expert parameters the source holds
    # (transformers' conversion mapping: experts merged along dim 0, projections
    # concatenated within each expert)
    expert_stacking = (
{rules}
    )

    def _stacked_experts(self, weights, loaded: set[str]):
        params = dict(self.named_parameters())
        for name, tensor in weights:
            for pattern, target, shard, shards in self.expert_stacking:
                found = pattern.match(name)
                if found is None:
                    continue
                param_name = found.group(1) + target
                param = params.get(param_name)
                if param is None:
                    # a layer of another pipeline stage, or experts fused into vLLM's
                    # MoE layer, whose own loader reads per-expert tensors
                    if not self._on_another_stage(param_name):
                        yield name, tensor
                    break
                expert = int(found.group(2))
                param.data[expert].chunk(shards, dim=0)[shard].copy_(tensor)
                loaded.add(param_name)
                break
            else:
                yield name, tensor

    def _on_another_stage(self, name: str) -> bool:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                module = self.get_submodule(".".join(parts[:i]))
            except AttributeError:
                continue
            return isinstance(module, PPMissingLayer)
        return False
"""


def loader_code(
    renames, stacking: list[Stacking], stacked_params, fused: dict | None = None
) -> tuple[str, str, str]:
    """(the class-level mapper, extra methods, the weights expression load_weights
    passes to its loader)."""
    fields = []
    if renames:
        items = ", ".join(f"WeightRenaming({s!r}, {t!r})" for s, t in renames)
        fields.append(f"orig_to_new_renaming=[{items}]")
    for kind, table in sorted((fused or {}).items()):
        fields.append(f"{kind}={_mapping(kind, table)}")
    if stacked_params:
        items = ",\n".join(
            f"            {k!r}: ({v!r}, {sid!r})" for k, v, sid in stacked_params
        )
        fields.append(f"orig_to_new_stacked={{\n{items}\n        }}")
    mapper = (
        "    # checkpoint names transformers renames at load (its conversion mapping), and\n"
        "    # checkpoint name -> (merged parameter, shard id) from the fusion records\n"
        f"    hf_to_vllm_mapper = WeightsMapper({', '.join(fields)})\n"
    )
    if not stacking:
        return mapper, "", "weights"
    rules = []
    for s in stacking:
        for j, src in enumerate(s.sources):
            rules.append(
                f'        (re.compile(r"{_glob_regex(src)}"), {s.target!r}, {j}, {len(s.sources)}),'
            )
    methods = STACK_METHOD.format(rules="\n".join(rules))
    return mapper, methods, "stacked"


def _mapping(kind: str, renames: dict[str, str]) -> str:
    if kind != "orig_to_new_regex":
        return repr(renames)
    # raw strings: the patterns read as the regexes they are
    return (
        "{" + ", ".join(f're.compile(r"{k}"): r"{v}"' for k, v in renames.items()) + "}"
    )
