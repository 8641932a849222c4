"""Arguments a copied class passes to another that the callee never reads.

Under vLLM a copied attention no longer reads what the source computed for its own
attention core (BLOOM's ALiBi tensor, a causal mask: vLLM's `Attention` holds the
slopes and the masking), yet the decoder layer still hands it over, and the base model
still builds it every forward. Here the keyword arguments of `self.<attr>(...)` calls
whose callee class (the one `__init__` builds `self.<attr>` as) does not read them in
its `forward` are dropped, the parameter gets a default, and the caller is looked at
again: a layer that only passed the value on no longer reads it, so the base model's
loop stops passing it (`dead_code.prune`) and the statements computing it die there.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import code
from fusion_patterns.emitting import DefaultNone

from ..copying.simplify import loads


def drop(pieces: dict[str, str]) -> None:
    """Drop, in place in `pieces` (class name -> text), every keyword argument a copied
    class passes to another copied class's forward that does not read it."""
    dropped: dict[str, set[str]] = {}  # callee class -> parameters no longer passed
    for _ in range(len(pieces) + 1):  # each round settles one more level of callers
        unread = {n: _unread(t) for n, t in pieces.items()}
        changed = False
        for name, text in pieces.items():
            module = cst.parse_module(text)
            built = _built_as(module, set(pieces))
            callees = {a: unread[c] for a, c in built.items() if unread[c]}
            if not callees:
                continue
            visitor = _DropUnread(callees)
            new = module.visit(visitor)
            if not new.deep_equals(module):
                pieces[name] = code(new)
                changed = True
                for attr, names in visitor.dropped.items():
                    dropped.setdefault(built[attr], set()).update(names)
        if not changed:
            break
    # a parameter no caller passes any more needs a default
    for name, names in dropped.items():
        pieces[name] = code(cst.parse_module(pieces[name]).visit(DefaultNone(names)))


def _forward(module: cst.Module) -> cst.FunctionDef | None:
    for f in m.findall(module, m.FunctionDef(name=m.Name("forward"))):
        return f
    return None


def _unread(text: str) -> set[str]:
    """The named parameters of the class's forward its body never reads."""
    func = _forward(cst.parse_module(text))
    if func is None:
        return set()
    named = {p.name.value for p in [*func.params.params, *func.params.kwonly_params]}
    return named - {"self"} - set(loads(func.body))


def _built_as(module: cst.Module, classes: set[str]) -> dict[str, str]:
    """`attr -> class` for each `self.<attr>` every construction in `__init__` builds
    as one class of `classes` (an attribute built as anything else is not listed)."""
    found: dict[str, set[str]] = {}
    for init in m.findall(module, m.FunctionDef(name=m.Name("__init__"))):
        for assign in m.findall(init, m.Assign()):
            for t in assign.targets:
                if not m.matches(t.target, m.Attribute(value=m.Name("self"))):
                    continue
                value = assign.value
                built = (
                    value.func.value
                    if isinstance(value, cst.Call) and isinstance(value.func, cst.Name)
                    else None
                )
                found.setdefault(t.target.attr.value, set()).add(
                    built if built in classes else ""
                )
    return {a: next(iter(c)) for a, c in found.items() if len(c) == 1 and "" not in c}


class _DropUnread(cst.CSTTransformer):
    """`self.<attr>(..., name=value)` -> without `name=` where the callee does not read
    it and `value` is a name or a constant (dropping it skips no computation)."""

    def __init__(self, callees: dict[str, set[str]]):
        self.callees = callees
        self.dropped: dict[str, set[str]] = {}

    def leave_Call(self, original, updated: cst.Call):
        f = updated.func
        if not m.matches(f, m.Attribute(value=m.Name("self"))):
            return updated
        unread = self.callees.get(f.attr.value)
        if not unread:
            return updated
        args = [
            a
            for a in updated.args
            if not (
                a.keyword is not None
                and a.keyword.value in unread
                and isinstance(a.value, (cst.Name, cst.Integer, cst.SimpleString))
            )
        ]
        if len(args) == len(updated.args):
            return updated
        self.dropped.setdefault(f.attr.value, set()).update(
            a.keyword.value for a in updated.args if all(a is not b for b in args)
        )
        if args:
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(args=args)
