"""Mamba-2 mixers -> vLLM's `MambaMixer2` (its conv and SSM states in vLLM's cache).

The match (`match.py`) reads the mixer's sizes as `MambaMixer2`'s arguments; the proof
(`proof.py`) runs the source mixer against vLLM's computation over a prefill and decode
steps with the states carried; `emit.py` writes the construction and the causal LM's
state methods from the same expressions. Claimed per construction: the mixer class is
not emitted, each `Mixer(config, ...)` becomes `MambaMixer2(...)`, and each call of it
takes vLLM's one row per token.
"""

from __future__ import annotations

from dataclasses import replace

import libcst as cst
import libcst.matchers as m

from ..base import Claim, ClassInfo, FusionRecord, LoaderHook, PatternRefused, code
from ..moe.match import resolve
from ..state_layers import (
    MAMBA2,
    NEGATED_A,
    StateMixer,
    call_sites,
    causal_hook,
    first_input,
)
from . import emit
from .match import NAME, VLLM_CLASS, WHAT, Mamba2Spec, match
from .proof import prove

__all__ = ["Mamba2", "NAME", "VLLM_CLASS", "WHAT", "Mamba2Spec", "match", "prove"]


class Mamba2(StateMixer):
    name = NAME
    what = WHAT

    def read(self, info: ClassInfo):
        return match(info)

    def proven(self, spec: Mamba2Spec, instance, model, cls: str) -> Mamba2Spec:
        spec = replace(spec, out_scale_value=_out_scale_value(spec, model))
        spec = replace(spec, unproven=prove(spec, instance, model.config))
        for call in call_sites(model, cls):
            _hidden(spec, call)
        return spec

    def record(self, spec: Mamba2Spec, scope: str) -> FusionRecord:
        return FusionRecord(
            NAME,
            spec.class_name,
            (spec.in_proj, spec.conv, "A_log + dt_bias + D", spec.norm, spec.out_proj),
            scope.rsplit(".", 1)[-1] or "mixer",
            VLLM_CLASS,
            scope=scope,
            detail="conv and SSM states in vLLM's state cache",
        )

    def dropped_buffers(self, claim: Claim) -> set[str]:
        # the output scale's buffer is folded into the in-projection's weight at load
        return {claim.spec.out_scale} if claim.spec.out_scale else set()

    def construction(self, claim: Claim, call: cst.Call, path: str | None) -> str:
        return emit.construction(claim.spec, call, path or "mixer")

    def call_site(self, claim: Claim, call: cst.Call) -> cst.BaseExpression:
        # vLLM's mixer takes one row per token; the copied layers hold [1, tokens, hidden]
        x = code(_hidden(claim.spec, call))
        return cst.parse_expression(
            f"{code(call.func)}({x}.flatten(0, -2)).view_as({x})"
        )

    def loader(self, claim: Claim) -> LoaderHook:
        scopes = sorted({r.scope for r in claim.records})
        ends = tuple(f".{s}.A_log" for s in scopes)
        methods = NEGATED_A.format(method="_mamba2_a", layer="MambaMixer2", ends=ends)
        weights = "self._mamba2_a({weights})"
        folded = emit.folded_scales(claim.spec, scopes)
        if folded:
            methods += folded
            weights = f"self._mamba2_scales({weights})"
        return LoaderHook(methods, weights=weights)

    def helpers(self, claim: Claim) -> tuple[str, ...]:
        spec = claim.spec
        return (
            (emit.SHARDED_BIAS,)
            + (() if spec.norm_grouped else (emit.ONE_GROUP,))
            + ((emit.PROVEN_FOR,) if spec.unproven else ())
            + ((emit.TIME_STEP_LIMIT,) if spec.time_step_limit is not None else ())
        )

    def causal_lm(self, claim: Claim, attends: bool):
        return causal_hook(MAMBA2, emit.state_shape(claim.spec), attends)


def _out_scale_value(spec: Mamba2Spec, model) -> str | None:
    """The output scale's value over `config`: what the mixer's `__init__` assigns it,
    or what a copied `__init__` registers as its buffer
    (`layer.mamba.register_buffer("mup_vector", mup_vector.clone())`, the local names
    it reads put back: `compute_mup_vector(config).clone()`)."""
    name = spec.out_scale
    if name is None:
        return None
    if name in spec.info.attrs:
        return code(resolve(spec.info.attrs[name], spec.info, {}))
    found = []
    for owner in model.roles.wanted:
        init = model.classes[owner].init
        if init is None:
            continue
        for call in m.findall(
            init, m.Call(func=m.Attribute(attr=m.Name("register_buffer")))
        ):
            args = [a.value for a in call.args]
            if len(args) >= 2 and m.matches(args[0], m.SimpleString()):
                if args[0].evaluated_value == name:
                    found.append(_locals_put_back(args[1], init))
    if len(found) != 1:
        raise PatternRefused(
            f"its in-projection's output is scaled by self.{name}, which "
            f"{len(found)} copied __init__ registers (expected one)"
        )
    return found[0]


def _locals_put_back(expr: cst.BaseExpression, func: cst.FunctionDef) -> str:
    """`expr` with each local name `func` assigns once replaced by its value."""
    values = {}
    for assign in m.findall(func, m.Assign(targets=[m.AssignTarget(m.Name())])):
        values.setdefault(assign.targets[0].target.value, []).append(assign.value)

    class PutBack(cst.CSTTransformer):
        def leave_Name(self, original, updated):
            found = values.get(original.value, [])
            return found[0] if len(found) == 1 else updated

    text = code(expr.visit(PutBack()))
    if "self." in text:
        raise PatternRefused(f"its output scale ({text}) reads its owner's attributes")
    return text


def _hidden(spec: Mamba2Spec, call: cst.Call) -> cst.BaseExpression:
    """The hidden states a call hands the mixer (its forward's first parameter), a
    name: the call site reads it twice."""
    value = first_input(spec.info, call)
    if isinstance(value, (cst.Name, cst.Attribute)):
        return value
    raise PatternRefused(f"it is called on an expression ({code(value)}), not a name")
