"""What the claims left dead: a claimed module takes vLLM's positions where the source
handed its layers rotary tables, so the base model's rotary module computes tables
nothing reads. Removed by dataflow, not by name:

- a decoder layer's forward parameter its body no longer reads is no longer passed by
  the base model's loop;
- a base-model statement whose names nothing reads afterwards, and which only calls
  parameter-free modules of the base model, is dropped, and so is the construction of
  a parameter-free module nothing calls any more;
- a class no remaining code names is not emitted.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import code

from ..copying.simplify import loads, stores


def prune(pieces: dict[str, str], roles, keep: set[str]) -> set[str]:
    """Prune `pieces` (class name -> text) in place; the names of the classes removed."""
    unused = None
    for n in roles.layer_classes:
        found = _unread_params(pieces.get(n, ""))
        unused = found if unused is None else unused & found
    base = roles.base.name
    stateless = {a for a, where in roles.placement.items() if where == "every"}
    pieces[base] = code(
        cst.parse_module(pieces[base]).visit(_PruneBase(unused or set(), stateless))
    )
    removed: set[str] = set()
    changed = True
    while changed:
        changed = False
        for n in list(pieces):
            if n in keep:
                continue
            others = "\n".join(t for k, t in pieces.items() if k != n)
            if not m.findall(cst.parse_module(others), m.Name(n)):
                del pieces[n]
                removed.add(n)
                changed = True
    return removed


def _forward(module: cst.Module) -> cst.FunctionDef | None:
    found = [
        f
        for f in m.findall(module, m.FunctionDef(name=m.Name("forward")))
        if isinstance(f, cst.FunctionDef)
    ]
    return found[0] if found else None


def _unread_params(text: str) -> set[str]:
    if not text:
        return set()
    func = _forward(cst.parse_module(text))
    if func is None:
        return set()
    named = {p.name.value for p in [*func.params.params, *func.params.kwonly_params]}
    return named - {"self"} - set(loads(func.body))


class _PruneBase(cst.CSTTransformer):
    def __init__(self, unread: set[str], stateless: set[str]):
        self.unread, self.stateless = unread, stateless

    def leave_FunctionDef(self, original, updated: cst.FunctionDef):
        if updated.name.value != "forward":
            return updated
        layer_vars = {
            n.value
            for loop in m.findall(updated.body, m.For())
            if m.findall(loop.iter, m.Call(func=m.Name("islice")))
            for n in m.findall(loop.target, m.Name())
        }
        body = updated.body.visit(_DropKeywords(self.unread, layer_vars))
        stmts = list(body.body)
        while True:
            dead = next(
                (
                    i
                    for i, s in enumerate(stmts)
                    if self._dead(s, cst.Module(body=stmts[i + 1 :]))
                ),
                None,
            )
            if dead is None:
                break
            del stmts[dead]
        return updated.with_changes(body=body.with_changes(body=stmts))

    def _dead(self, stmt, rest: cst.Module) -> bool:
        if not m.matches(stmt, m.SimpleStatementLine([m.Assign()])):
            return False
        value = stmt.body[0].value
        calls = m.findall(value, m.Call())
        pure = all(
            m.matches(c.func, m.Attribute(value=m.Name("self")))
            and c.func.attr.value in self.stateless
            for c in calls
        )
        return pure and not (stores(stmt) & set(loads(rest)))

    def leave_ClassDef(self, original, updated: cst.ClassDef):
        targets = {
            id(t.target)
            for t in m.findall(updated, m.AssignTarget(m.Attribute(value=m.Name("self"))))
        }
        used = {
            a.attr.value
            for a in m.findall(updated, m.Attribute(value=m.Name("self")))
            if id(a) not in targets
        }
        return updated.visit(_DropConstructions(self.stateless - used))


class _DropKeywords(cst.CSTTransformer):
    """The keyword arguments of the layer call the layer no longer reads."""

    def __init__(self, names: set[str], layer_vars: set[str]):
        self.names, self.layer_vars = names, layer_vars

    def leave_Call(self, original, updated: cst.Call):
        if not (
            isinstance(updated.func, cst.Name) and updated.func.value in self.layer_vars
        ):
            return updated
        args = [
            a
            for a in updated.args
            if a.keyword is None or a.keyword.value not in self.names
        ]
        if len(args) == len(updated.args):
            return updated
        if args:
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(args=args)


class _DropConstructions(cst.CSTTransformer):
    """`self.<attr> = ...` in `__init__` for parameter-free modules nothing uses."""

    def __init__(self, attrs: set[str]):
        self.attrs = attrs

    def leave_SimpleStatementLine(self, original, updated):
        if m.matches(
            updated,
            m.SimpleStatementLine(
                [
                    m.Assign(
                        targets=[
                            m.AssignTarget(
                                m.Attribute(
                                    value=m.Name("self"),
                                    attr=m.Name(m.MatchIfTrue(lambda a: a in self.attrs)),
                                )
                            )
                        ]
                    )
                ]
            ),
        ):
            return cst.RemoveFromParent()
        return updated
