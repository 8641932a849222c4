"""A sparse MoE block (a top-k router and stacked experts) -> vLLM's fused MoE layer.

Claimed whole where the match (`match.py`) and the proof on the block the tiny model
built (`proof.py`) hold; emitted by `emit.py`. A block it refuses is copied.
"""

from __future__ import annotations

from ..base import CLASS, Claim, ClassInfo, Pattern, PatternRefused, Refusal
from .emit import emit
from .match import NAME, VLLM_CLASS, MoESpec, match, records
from .proof import fused_reference, prove

WHAT = "router + experts"

__all__ = ["MoE", "MoESpec", "NAME", "VLLM_CLASS", "fused_reference", "match", "prove"]


class MoE(Pattern):
    name = NAME

    def claim(self, model):
        for n in model.sublayer_candidates():
            spec = match(model.classes[n], model.classes)
            inst = model.first(n)
            if spec is None or inst is None:
                continue
            if isinstance(spec, Refusal):
                yield spec
                continue
            try:
                prove(spec, inst, model.config)
            except PatternRefused as why:
                yield Refusal(NAME, n, WHAT, str(why))
                continue
            except Exception as exc:  # a proof that cannot even run is a refusal
                text = str(exc).splitlines()[0] if str(exc) else ""
                yield Refusal(
                    NAME, n, WHAT, f"proof failed to run: {type(exc).__name__}: {text}"
                )
                continue
            yield Claim(
                self,
                n,
                spec,
                CLASS,
                records=[
                    r for scope in model.roles.scopes.get(n, [""]) for r in records(spec, scope)
                ],
                experts=(spec.experts.gate_up, spec.experts.down),
            )

    def emit_class(self, claim: Claim, info: ClassInfo) -> str:
        return emit(info, claim.spec)
