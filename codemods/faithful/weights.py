"""Checkpoint names for a faithful file: transformers' own conversions, applied by the
generated loader as transformers applies them at load.

Published checkpoints keep their original names; transformers renames them at load
(`WeightRenaming`, used as is: vLLM's `WeightsMapper` takes transformers' objects) and
stacks per-expert tensors into a MoE block's 3-D parameters (`WeightConverter` with
`MergeModulelist` and `Concatenate`). The faithful experts keep the source's stacked
parameters, so the generated loader writes each per-expert tensor into its slice.
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


def conversions(causal_cls, model_type: str):
    """(renames as WeightRenaming constructor arguments, expert stackings)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    found = (
        get_checkpoint_conversion_mapping(causal_cls.__name__)
        or get_checkpoint_conversion_mapping(model_type)
        or []
    )
    renames: list[tuple[list[str], list[str]]] = []
    stacking: list[Stacking] = []
    for conv in found:
        sources = list(conv.source_patterns)
        targets = list(conv.target_patterns)
        if type(conv) is WeightRenaming:
            renames.append((sources, targets))
            continue
        if isinstance(conv, WeightConverter):
            ops = [(type(o).__name__, getattr(o, "dim", None)) for o in conv.operations]
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
    return renames, stacking


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
    renames, stacking: list[Stacking], stacked_params
) -> tuple[str, str, str]:
    """(the class-level mapper, extra methods, the weights expression load_weights
    passes to its loader)."""
    fields = []
    if renames:
        items = ", ".join(f"WeightRenaming({s!r}, {t!r})" for s, t in renames)
        fields.append(f"orig_to_new_renaming=[{items}]")
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
