"""Stage 3: the fusion records of one model and every table derived from them.

The rewrite, `packed_modules_mapping`, the stacked weight mapping and the report all
read the same records, so a fusion cannot appear in one table and be missing in another.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import libcst.matchers as m

from fusion_patterns import glu, mla, moe, qkv, residual_norm, rms_norm
from fusion_patterns.base import FusionRecord, Refusal, ShardId

from .structure import ModelStructure


@dataclass
class ModelPlan:
    structure: ModelStructure
    layout = "native"

    @property
    def source(self):
        return self.structure.source

    @property
    def causal_name(self) -> str:
        return self.structure.causal.name

    @property
    def records(self) -> list[FusionRecord]:
        """The fusions that fired, derived from the specs that survived matching and proof."""
        s = self.structure
        out: list[FusionRecord] = []
        for owner in (s.layer, s.base):
            for attr, cls in s.norm_attrs(owner).items():
                out.append(rms_norm.record(s.norms[cls], owner.name, attr))
        if isinstance(s.attention, mla.MLASpec):
            out += mla.records(s.attention, s.attn_attr)
            # its latent and q norms become vLLM norms too
            attn = s.classes[s.attention.class_name]
            for attr in (s.attention.q_norm, s.attention.kv_norm):
                cls = mla.norm_class(attn, attr)
                out.append(rms_norm.record(s.norms[cls], attn.name, attr))
        else:
            out += qkv.records(s.attention, s.attn_attr, set(s.norms))
        for cls, spec in s.mlps.items():
            for scope in s.mlp_scopes[cls]:
                found = []
                if isinstance(spec, moe.MoESpec):
                    found = moe.records(spec, scope)
                elif spec is not None:
                    found = glu.records(spec, scope)
                if scope != s.mlp_attr:  # shared experts: say where
                    found = [replace(r, detail=f"in self.{scope}") for r in found]
                out += found
        if s.layer_spec is not None:
            vllm_norms = {
                attr: s.norms[cls].vllm_class
                for attr, cls in s.norm_attrs(s.layer).items()
            }
            out += residual_norm.records(s.layer_spec, vllm_norms)
        return out

    @property
    def refusals(self) -> list[Refusal]:
        return self.structure.refusals

    @property
    def tied_embeddings(self) -> bool:
        """Whether the source declares its head tied to the input embeddings."""
        tied = m.Assign(targets=[m.AssignTarget(m.Name("_tied_weights_keys"))])
        return bool(m.findall(self.structure.causal.node, tied))

    def stacked(self) -> list[FusionRecord]:
        return [r for r in self.records if r.stacks_weights]

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
            for r in self.stacked()
            for source, shard in zip(r.sources, r.shard_ids)
        ]

    def kept(self) -> list[str]:
        """Arithmetic the source does outside the fusions, emitted as the source has it."""
        s = self.structure
        out = residual_norm.kept(s.layer_spec) if s.layer_spec else []
        if s.embed_scale is not None:
            out.append(s.embed_scale.describe())
        for kind, renames in s.checkpoint_renames.items():
            why = (
                "the per-expert name vLLM's fused MoE loader reads"
                if kind in ("orig_to_new_regex", "orig_to_new_suffix")
                else "as transformers renames it"
            )
            out += [
                f"checkpoint name `{_readable(old)}` loaded as `{_readable(new)}`, {why}"
                for old, new in renames.items()
            ]
        return out + s.logits.describe()

    def report(self) -> list[str]:
        return (
            [r.describe() for r in self.records]
            + [f"Kept: {line}" for line in self.kept()]
            + [r.describe() for r in self.refusals]
        )


def _readable(name: str) -> str:
    """A per-expert rename's regex as a name: `\\.experts\\.(\\d+)\\.w1\\.` -> `.experts.<e>.w1.`."""
    return name.replace(r"(\d+)", "<e>").replace(r"\1", "<e>").replace(r"\.", ".")


def plan(structure: ModelStructure) -> ModelPlan:
    return ModelPlan(structure)
