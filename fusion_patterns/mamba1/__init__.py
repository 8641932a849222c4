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

from ..base import Claim, ClassInfo, FusionRecord, LoaderHook
from ..state_layers import (
    CALL,
    MAMBA1,
    NEGATED_A,
    StateMixer,
    call_state_layer,
    causal_hook,
    construction_constants,
)
from . import emit
from .match import NAME, VLLM_CLASS, WHAT, Mamba1Spec, match
from .proof import norm_weights, prove

__all__ = ["Mamba1", "NAME", "VLLM_CLASS", "Mamba1Spec", "match", "prove"]


class Mamba1(StateMixer):
    name = NAME
    what = WHAT

    def read(self, info: ClassInfo):
        return match(info)

    def proven(self, spec: Mamba1Spec, instance, model, cls: str) -> Mamba1Spec:
        spec = replace(spec, norm_weights=norm_weights(spec, instance))
        prove(
            spec,
            instance,
            model.config,
            constants=construction_constants(model, cls),
        )
        return spec

    def record(self, spec: Mamba1Spec, scope: str) -> FusionRecord:
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
        return (emit.SCAN_BY_STEPS, emit.CPU_MIXER, CALL)

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
