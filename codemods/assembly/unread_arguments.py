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

from fusion_patterns.base import ClassInfo, code
from fusion_patterns.emitting import DefaultNone

from ..copying.simplify import loads
from ..source import class_infos


def drop(pieces: dict[str, str]) -> None:
    """Drop, in place in `pieces` (class name -> text), every keyword argument a copied
    class passes to another copied class's forward that does not read it."""
    dropped: dict[str, set[str]] = {}  # callee class -> parameters no longer passed
    for _ in range(len(pieces) + 1):  # each round settles one more level of callers
        infos = {n: i for n, t in pieces.items() if (i := class_info(t)) is not None}
        unread = {n: unread_params(i.forward) for n, i in infos.items()}
        changed = False
        for name, info in infos.items():
            built = _built_as(info, set(infos))
            callees = {a: unread[c] for a, c in built.items() if unread[c]}
            if not callees:
                continue
            module = cst.parse_module(pieces[name])
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


def unread_params(forward: cst.FunctionDef | None) -> set[str]:
    """The named parameters of a forward its body never reads."""
    if forward is None:
        return set()
    params = [*forward.params.params, *forward.params.kwonly_params]
    return {p.name.value for p in params} - {"self"} - set(loads(forward.body))


def without_keywords(call: cst.Call, drop) -> tuple[cst.Call, set[str]]:
    """`call` without the keyword arguments `drop(arg)` picks, and their names."""
    args = [a for a in call.args if a.keyword is None or not drop(a)]
    if len(args) == len(call.args):
        return call, set()
    names = {a.keyword.value for a in call.args if a.keyword is not None and drop(a)}
    if args:
        args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return call.with_changes(args=args), names


def class_info(text: str) -> ClassInfo | None:
    """The class `text` defines, as the patterns read classes (None: none)."""
    return next(iter(class_infos(cst.parse_module(text)).values()), None)


def _built_as(info: ClassInfo, classes: set[str]) -> dict[str, str]:
    """`attr -> class` for each `self.<attr>` every construction in `__init__` builds
    as one class of `classes` (an attribute built as anything else is not listed)."""
    out = {}
    for attr, values in info.choices.items():
        built = {
            (
                v.func.value
                if isinstance(v, cst.Call) and isinstance(v.func, cst.Name)
                else ""
            )
            for v in values
        }
        if len(built) == 1 and next(iter(built)) in classes:
            out[attr] = next(iter(built))
    return out


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
        updated, names = without_keywords(
            updated,
            lambda a: a.keyword.value in unread
            and isinstance(a.value, (cst.Name, cst.Integer, cst.SimpleString)),
        )
        if names:
            self.dropped.setdefault(f.attr.value, set()).update(names)
        return updated
