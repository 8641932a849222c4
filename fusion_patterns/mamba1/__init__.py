"""Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba) -> vLLM's `MambaMixer` (its conv and SSM
states in vLLM's state cache).

The match (`match.py`) reads the mixer's sizes as `MambaMixer`'s arguments; the proof
(`proof.py`) runs the source mixer against the generated mixer's computation over a
prefill and decode steps with the states carried; `emit.py` writes the construction
and, for vLLM's CPU build (no selective-scan kernel), the prefill scan in torch.
Claimed per construction: the mixer class is not emitted, each `Mixer(config, ...)`
becomes `MambaMixerOnCPU(...)` (vLLM's `MambaMixer` off CPU), and each call hands it one
row per token.
"""

from __future__ import annotations

from dataclasses import replace

import libcst as cst

from ..base import (
    CONSTRUCTION,
    Claim,
    ClassInfo,
    FusionRecord,
    LoaderHook,
    Pattern,
    PatternRefused,
    Refusal,
    refused_by,
)
from ..state_layers import (
    CALL,
    MAMBA1,
    NEGATED_A,
    call_sites,
    call_state_layer,
    causal_hook,
    construction_constants,
)
from . import emit
from .match import NAME, VLLM_CLASS, WHAT, Mamba1Spec, match
from .proof import norm_weights, prove

__all__ = ["Mamba1", "NAME", "VLLM_CLASS", "Mamba1Spec", "match", "prove"]


class Mamba1(Pattern):
    name = NAME
    rewrites_calls = True
    keyed_by_prefix = True

    def maps_state(self, info: ClassInfo) -> bool:
        return match(info) is not None  # a near miss too: its refusal says why

    def claim(self, model):
        for n in model.roles.wanted:
            spec = match(model.classes[n])
            if spec is None:
                continue
            if isinstance(spec, Refusal):
                yield spec
                continue
            try:
                inst = model.first(n)
                if inst is None:
                    raise PatternRefused("the tiny model never builds it")
                spec = replace(spec, norm_weights=norm_weights(spec, inst))
                prove(
                    spec,
                    inst,
                    model.config,
                    constants=construction_constants(model, n),
                )
                if not call_sites(model, n):
                    raise PatternRefused("no copied module calls it")
            except Exception as exc:  # a proof that fails or cannot run: refused
                yield refused_by(exc, NAME, n, WHAT)
                continue
            scopes = model.roles.scopes.get(n, [""])
            yield Claim(
                self,
                n,
                spec,
                CONSTRUCTION,
                records=[_record(spec, scope) for scope in scopes],
            )

    def construction(self, claim: Claim, call: cst.Call, path: str | None) -> str:
        return emit.construction(claim.spec, call, path or "mixer")

    def call_site(self, claim: Claim, call: cst.Call) -> cst.BaseExpression:
        return call_state_layer(call, claim.spec.info)

    def loader(self, claim: Claim) -> LoaderHook:
        scopes = sorted({r.scope for r in claim.records})
        ends = tuple(f".{s}.A_log" for s in scopes)
        methods = NEGATED_A.format(method="_mamba1_a", layer="MambaMixer", ends=ends)
        return LoaderHook(methods, weights="self._mamba1_a({weights})")

    def helpers(self, claim: Claim) -> tuple[str, ...]:
        return (emit.SCAN_BY_STEPS, CALL)

    def slow_paths(self, claim: Claim) -> tuple[tuple[str, str], ...]:
        return (
            (
                "Python loop",
                "on vLLM's CPU build only: its selective scan runs in torch one step "
                "per token (`selective_scan_by_steps`), as vLLM's CPU build has no "
                "kernel for Mamba-1's scan; vLLM's kernels everywhere else",
            ),
        )

    def causal_lm(self, claim: Claim, attends: bool):
        return causal_hook(MAMBA1, emit.state_shape(claim.spec), attends)


def _record(spec: Mamba1Spec, scope: str) -> FusionRecord:
    norms = " + dt/B/C norms" if spec.normed else ""
    return FusionRecord(
        NAME,
        spec.class_name,
        ("in_proj", spec.conv, "x_proj + dt_proj" + norms, "A_log + D", "out_proj"),
        scope.rsplit(".", 1)[-1] or "mixer",
        VLLM_CLASS,
        scope=scope,
        detail="conv and SSM states in vLLM's state cache",
    )
