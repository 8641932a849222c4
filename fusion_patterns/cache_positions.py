"""Positions counted from the cache -> vLLM's positions (a rewrite of the copy).

A transformers module may count the positions of the tokens it is handed from the cache
it is handed: `positions = torch.arange(hidden_states.shape[1]) + past_seen_tokens`, with
`past_seen_tokens = past_key_values.get_seq_length(...)` (Llama 4's attention
temperature). vLLM hands a module no cache, so the copy folds the length to 0 and the
positions would restart at 0 on every decode step. vLLM hands every token's position
instead: the statement becomes vLLM's `positions` (one per token of the flattened batch:
the source's numbers for one sequence, and right for several, where the source's count
is not), and the cache-length name is no longer read.

Matched, and proven on the probe's call: `<name> = torch.arange(<x>.shape[1], ...) +
<length>` (either order), `<length>` set from the cache's length in the same forward,
`<x>` a forward parameter the probe handed as [1, tokens, ...] (vLLM runs a batch of
one sequence, so its dim 1 is the token count vLLM's positions have).
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from .base import (
    REWRITE,
    Claim,
    ClassInfo,
    FusionRecord,
    Pattern,
    Refusal,
    code,
    with_positions_param,
)

NAME = "cache_positions"
WHAT = "positions from the cache's length"
CACHE_LENGTH = m.Call(func=m.Attribute(attr=m.Name("get_seq_length")))
_ARANGE = m.Call(
    func=m.Attribute(value=m.Name("torch"), attr=m.Name("arange")),
    args=[
        m.Arg(
            m.Subscript(
                value=m.Attribute(value=m.Name(), attr=m.Name("shape")),
                slice=[m.SubscriptElement(m.Index(m.Integer("1")))],
            ),
            keyword=None,
        ),
        m.ZeroOrMore(m.Arg(keyword=m.Name())),
    ],
)


def cache_length_names(method: cst.FunctionDef) -> dict[str, str]:
    """{name: its assignment} for the names `method` sets from the cache's length."""
    out = {}
    for assign in m.findall(method, m.Assign()):
        if not m.findall(assign.value, CACHE_LENGTH):
            continue
        for target in assign.targets:
            if isinstance(target.target, cst.Name):
                out[target.target.value] = (
                    f"{target.target.value} = {code(assign.value)}"
                )
    return out


@dataclass(frozen=True)
class CachePositionsSpec:
    target: str  # the name the source binds the positions to
    length: str  # the cache-length name it adds
    tokens_of: str  # the forward parameter whose dim 1 counts the tokens
    statement: str  # the source's assignment, for the report


def _count_from_cache(value: cst.BaseExpression, lengths) -> tuple[str, str] | None:
    """(cache-length name, tensor whose dim 1 is counted) where `value` is
    `torch.arange(<x>.shape[1], ...) + <length>` (either order), else None."""
    if not m.matches(value, m.BinaryOperation(operator=m.Add())):
        return None
    for arange, length in ((value.left, value.right), (value.right, value.left)):
        if m.matches(arange, _ARANGE) and m.matches(length, m.Name()):
            if length.value in lengths:
                shape = arange.args[0].value  # <x>.shape[1]
                return length.value, shape.value.value.value
    return None


def match(info: ClassInfo) -> list[CachePositionsSpec]:
    if info.forward is None:
        return []
    lengths = cache_length_names(info.forward)
    out = []
    for assign in m.findall(info.forward, m.Assign(targets=[m.AssignTarget(m.Name())])):
        if (found := _count_from_cache(assign.value, lengths)) is not None:
            target = assign.targets[0].target.value
            out.append(
                CachePositionsSpec(target, *found, f"{target} = {code(assign.value)}")
            )
    return out


def _handed_tokens_first(model, inst, spec: CachePositionsSpec) -> str | None:
    """Why the probe's call does not show `spec.tokens_of` as [1, tokens, ...], or None."""
    import inspect

    call = model.call(inst)
    if call is None:
        return "the tiny model never calls it"
    args, kwargs, _ = call
    try:
        bound = inspect.signature(type(inst).forward).bind(inst, *args, **kwargs)
    except TypeError:
        return "its call in the tiny model does not bind to its forward"
    x = bound.arguments.get(spec.tokens_of)
    if getattr(x, "dim", lambda: 0)() < 2 or x.shape[0] != 1:
        return f"`{spec.tokens_of}` is not handed as [1, tokens, ...]"
    return None


class CachePositions(Pattern):
    name = NAME

    def claim(self, model):
        roles = model.roles
        for n in roles.wanted:
            if n in (roles.causal.name, roles.base.name) or model.claimed_whole(n):
                continue
            specs = match(model.classes[n])
            if not specs:
                continue
            inst = model.first(n)
            why = (
                "the tiny model builds none"
                if inst is None
                else next(
                    filter(None, (_handed_tokens_first(model, inst, s) for s in specs)),
                    None,
                )
            )
            if why is not None:
                yield Refusal(NAME, n, WHAT, why)
                continue
            yield Claim(
                self,
                n,
                specs,
                REWRITE,
                records=[
                    FusionRecord(
                        NAME,
                        n,
                        (s.target,),
                        "positions",
                        "vLLM's positions",
                        detail=f"for `{' '.join(s.statement.split())}`",
                    )
                    for s in specs
                ],
                needs_positions=True,
            )

    def rewrite_class(self, claim: Claim, node: cst.ClassDef) -> cst.ClassDef:
        return node.visit(_ToPositions(claim.spec))


class _ToPositions(cst.CSTTransformer):
    """`<name> = torch.arange(...) + <length>` -> `<name> = positions` (dropped where
    the name is `positions` itself), in a forward that takes vLLM's `positions`."""

    def __init__(self, specs: list[CachePositionsSpec]):
        self.targets = {s.target for s in specs}
        self.lengths = {s.length for s in specs}

    def leave_Assign(self, original, updated: cst.Assign):
        if not (
            m.matches(updated, m.Assign(targets=[m.AssignTarget(m.Name())]))
            and updated.targets[0].target.value in self.targets
            and _count_from_cache(updated.value, self.lengths) is not None
        ):
            return updated
        return updated.with_changes(value=cst.Name("positions"))

    def leave_SimpleStatementLine(self, original, updated):
        if len(updated.body) == 1 and m.matches(
            updated.body[0],
            m.Assign(
                targets=[m.AssignTarget(m.Name("positions"))], value=m.Name("positions")
            ),
        ):
            return cst.RemoveFromParent()
        return updated

    def leave_FunctionDef(self, original, updated: cst.FunctionDef):
        if updated.name.value != "forward":
            return updated
        return with_positions_param(updated)
