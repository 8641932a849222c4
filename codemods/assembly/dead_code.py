"""What the claims left dead: a claimed module takes vLLM's positions where the source
handed its layers rotary tables, so the base model's rotary module computes tables
nothing reads. Removed by dataflow, not by name:

- a copied class's forward parameter its body no longer reads is no longer passed by
  the copied classes that call it (`unread_arguments`), nor by the base model's loop;
- a base-model statement whose names nothing reads afterwards, and which only makes
  calls that change nothing (`pure_calls`: tensor ops, parameter-free modules of the
  base model, helpers that only compute), is dropped, and so is the construction of a
  parameter-free module nothing calls any more;
- a class no remaining code names is not emitted.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import code
from fusion_patterns.emitting import DefaultNone

from ..copying.simplify import loads
from . import unread_arguments
from .unread_arguments import class_info, unread_params, without_keywords
from .pure_calls import PureCalls


def prune(pieces: dict[str, str], roles, keep: set[str], functions: dict) -> set[str]:
    """Prune `pieces` (class name -> text) in place; the names of the classes removed.
    `functions`: the source's module-level definitions (name -> node) the base model
    may call."""
    unread_arguments.drop(pieces)
    unused = None
    for n in roles.layer_classes:
        info = class_info(pieces[n]) if n in pieces else None
        found = unread_params(info.forward) if info is not None else set()
        unused = found if unused is None else unused & found
    # the loop no longer passes them: a parameter without a default gets one
    for n in roles.layer_classes:
        if n in pieces and unused:
            pieces[n] = code(cst.parse_module(pieces[n]).visit(DefaultNone(unused)))
    base = roles.base.name
    stateless = {a for a, where in roles.placement.items() if where == "every"}
    pieces[base] = code(
        cst.parse_module(pieces[base]).visit(
            _PruneBase(unused or set(), stateless, functions)
        )
    )
    # a piece no other piece names goes, until none does (each piece parsed once)
    names = {
        k: {n.value for n in m.findall(cst.parse_module(t), m.Name())}
        for k, t in pieces.items()
    }
    removed: set[str] = set()
    changed = True
    while changed:
        changed = False
        for n in list(pieces):
            if n in keep:
                continue
            if not any(n in found for k, found in names.items() if k != n):
                del pieces[n], names[n]
                removed.add(n)
                changed = True
    return removed


class _PruneBase(cst.CSTTransformer):
    def __init__(self, unread: set[str], stateless: set[str], functions: dict):
        self.unread, self.stateless = unread, stateless
        self.functions = functions
        self.pure: PureCalls | None = None

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        methods = {
            f.name.value: f
            for f in node.body.body
            if isinstance(f, cst.FunctionDef) and f.name.value != "forward"
        }
        # one per class: what it learns of a helper's body holds for every statement
        self.pure = PureCalls(self.stateless, methods, self.functions)

    def leave_FunctionDef(self, original, updated: cst.FunctionDef):
        if updated.name.value != "forward":
            return updated
        layer_vars = {
            n.value
            for loop in m.findall(updated.body, m.For())
            if m.findall(loop.iter, m.Call(func=m.Name("islice")))
            for n in m.findall(loop.target, m.Name())
        }
        self.params = {
            p.name.value
            for p in [*updated.params.params, *updated.params.kwonly_params]
        }
        body = updated.body.visit(_DropKeywords(self.unread, layer_vars))
        stmts = list(body.body)
        while True:
            # what the statements after each one read (each statement's reads once)
            reads = [set(loads(s)) for s in stmts]
            later: list[set[str]] = [set() for _ in stmts]
            for i in range(len(stmts) - 2, -1, -1):
                later[i] = later[i + 1] | reads[i + 1]
            dead = next(
                (i for i, s in enumerate(stmts) if self._dead(s, later[i])), None
            )
            if dead is None:
                break
            del stmts[dead]
        return updated.with_changes(body=body.with_changes(body=stmts))

    def _dead(self, stmt, later_reads: set[str]) -> bool:
        """Nothing after `stmt` reads what it binds, and running it does nothing else:
        it only binds local names (or items of them) and only makes calls that change
        nothing (a mask's keyword dict, a rotary table per layer type filled in a loop,
        BLOOM's ALiBi tensor)."""
        found = _local_stores(stmt)
        if not found:
            return False
        # an item set on a parameter changes the caller's object
        if {n[1:] for n in found if n.startswith("[")} & self.params:
            return False
        bound = {n.lstrip("[") for n in found}
        return not (bound & later_reads) and self.pure.holds(stmt)

    def leave_ClassDef(self, original, updated: cst.ClassDef):
        targets = {
            id(t.target)
            for t in m.findall(
                updated, m.AssignTarget(m.Attribute(value=m.Name("self")))
            )
        }
        used = {
            a.attr.value
            for a in m.findall(updated, m.Attribute(value=m.Name("self")))
            if id(a) not in targets
        }
        return updated.visit(_DropConstructions(self.stateless - used))


def _local_stores(stmt) -> set[str] | None:
    """The local names `stmt` binds or whose items it sets; None when it does anything
    else (a call as a statement, an attribute set, a return, a `del`...)."""
    if isinstance(stmt, cst.SimpleStatementLine):
        out: set[str] = set()
        for small in stmt.body:
            if isinstance(small, cst.Assign):
                targets = [t.target for t in small.targets]
            elif isinstance(small, (cst.AugAssign, cst.AnnAssign)):
                targets = [small.target]
            else:
                return None
            for t in targets:
                names = _bound_names(t)
                if names is None:
                    return None
                out |= names
        return out
    if isinstance(stmt, cst.For) and stmt.orelse is None:
        inner = _block_stores(stmt.body)
        target = _bound_names(stmt.target)
        return None if inner is None or target is None else inner | target
    if isinstance(stmt, cst.If):
        inner = _block_stores(stmt.body)
        other = (
            _local_stores(stmt.orelse)
            if isinstance(stmt.orelse, cst.If)
            else (_block_stores(stmt.orelse.body) if stmt.orelse is not None else set())
        )
        return None if inner is None or other is None else inner | other
    return None


def _block_stores(block) -> set[str] | None:
    out: set[str] = set()
    for s in block.body:
        found = _local_stores(s)
        if found is None:
            return None
        out |= found
    return out


def _bound_names(target) -> set[str] | None:
    if isinstance(target, cst.Name):
        return {target.value}
    if isinstance(target, cst.Subscript) and isinstance(target.value, cst.Name):
        # "[" marks an item set: the object is changed, not rebound
        return {"[" + target.value.value} if target.value.value != "self" else None
    if isinstance(target, (cst.Tuple, cst.List)):
        out: set[str] = set()
        for e in target.elements:
            names = _bound_names(e.value)
            if names is None:
                return None
            out |= names
        return out
    return None


class _DropKeywords(cst.CSTTransformer):
    """The keyword arguments of the layer call the layer no longer reads."""

    def __init__(self, names: set[str], layer_vars: set[str]):
        self.names, self.layer_vars = names, layer_vars

    def leave_Call(self, original, updated: cst.Call):
        if not (
            isinstance(updated.func, cst.Name) and updated.func.value in self.layer_vars
        ):
            return updated
        return without_keywords(updated, lambda a: a.keyword.value in self.names)[0]


class _DropConstructions(cst.CSTTransformer):
    """`self.<attr> = ...` in `__init__` for parameter-free modules nothing uses."""

    def __init__(self, attrs: set[str]):
        self.attrs = attrs

    def builds(self, stmt) -> bool:
        return m.matches(
            stmt,
            m.SimpleStatementLine(
                [
                    m.Assign(
                        targets=[
                            m.AssignTarget(
                                m.Attribute(
                                    value=m.Name("self"),
                                    attr=m.Name(
                                        m.MatchIfTrue(lambda a: a in self.attrs)
                                    ),
                                )
                            )
                        ]
                    )
                ]
            ),
        )

    def leave_SimpleStatementLine(self, original, updated):
        return cst.RemoveFromParent() if self.builds(updated) else updated
