"""The one plan of a generated file: what every pattern claimed (its records), what it
refused and why, what stays as the source has it, and the tables derived from the same
records (`packed_modules_mapping`, the stacked weight mapping, the report), so a fusion
cannot appear in one table and be missing from another."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `check` reads plans' files without libcst's matchers (0.5 s)
    from fusion_patterns.base import FusionRecord, Refusal, ShardId

from .source import ModelSource


@dataclass
class Plan:
    source: ModelSource
    causal_name: str
    records: list[FusionRecord] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    # parts emitted as the source computes them (each an `Unfused` line)
    unfused: list = field(default_factory=list)
    # environment vLLM must run the file with (a model type vLLM treats as MLA)
    environment: dict[str, str] = field(default_factory=dict)
    # vLLM's per-architecture config setup the file is registered with (an
    # attention-free state model: `MambaModelConfig` sizes its state blocks)
    vllm_config: str = ""
    # (dtype, why): the only dtype vLLM's CPU build runs the file in (its header says
    # so; `verify` runs it so on CPU)
    cpu_dtype: tuple[str, str] | None = None

    @property
    def layout(self) -> str:
        """ "native" when every part is claimed (vLLM's own layout), else "faithful"."""
        return "faithful" if any(not u.kept for u in self.unfused) else "native"

    def report(self) -> list[str]:
        return (
            [r.describe() for r in self.records]
            + [u.describe() for u in self.unfused]
            + [r.describe() for r in self.refusals]
        )

    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return {
            r.target: list(r.sources)
            for r in self.records
            if r.stacks_weights or r.packed
        }

    def stacked_params(self) -> list[tuple[str, str, ShardId]]:
        """(checkpoint substring, merged substring, shard id), scoped to the owning module
        so a same-named projection elsewhere (an expert's `gate_proj`) is never caught.
        """
        return [
            (f".{r.scope}.{source}.", f".{r.scope}.{r.target}.", shard)
            for r in self.records
            if r.stacks_weights
            for source, shard in zip(r.sources, r.shard_ids)
        ]
