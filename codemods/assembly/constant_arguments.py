"""Constants every caller hands a copied class, folded into its forward; a module that
then hands back one of its inputs unchanged is not built at all.

Under vLLM a base model's forward takes token ids and positions only, so what the
source passed its modules from other inputs is a constant in the copy (Phi-4-multimodal
hands its image-and-audio embedding `image_pixel_values=None, audio_input_features=None`).
Where every call of a copied class passes a parameter the same literal, that literal
is folded into the class's forward (`copying.simplify`: the branches it decides go),
and a forward left as `return <parameter>` is an identity: its calls become the value
passed, and a base-model module built only to be called so is not built, its
checkpoint tensors skipped at load (an image tower, a speech encoder: weights a text
model never reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, code

from ..copying.inference import is_docstring
from ..branches import _passed as passed_for
from ..copying.simplify import is_constant, simplify_function
from .dead_code import _DropConstructions, _local_stores
from .pure_calls import PureCalls
from .unread_arguments import class_info


@dataclass
class Unbuilt:
    """A base-model module the file does not build."""

    attr: str
    cls: str
    returns: str  # the parameter its forward hands back
    constants: dict[str, str]  # what every call passes, folded into it

    def describe(self) -> str:
        given = ", ".join(f"{k}={v}" for k, v in sorted(self.constants.items()))
        return (
            f"{self.attr} ({self.cls}) returns `{self.returns}` unchanged under what "
            f"every call hands it ({given}): not built, its checkpoint tensors skipped "
            "at load"
        )


def fold(pieces: dict[str, str], base: str) -> list[Unbuilt]:
    """Fold, in place in `pieces` (class name -> text), the constants every caller
    passes; drop the base model's (`base`) modules that became identities, and say
    which."""
    folded_in: dict[str, dict[str, str]] = {}
    for _ in range(len(pieces) + 1):
        infos = _infos(pieces)
        calls = _calls(infos)
        changed = False
        for name, found in calls.items():
            forward = infos[name].forward
            known = _constants(forward, found)
            if not known:
                continue
            folded_in.setdefault(name, {}).update(known)
            folded = simplify_function(forward, known)
            if not folded.deep_equals(forward):
                pieces[name] = code(
                    cst.parse_module(pieces[name]).visit(_Replace(forward, folded))
                )
                changed = True
        if not changed:
            break
    infos = _infos(pieces)
    identities = {
        n: p for n, i in infos.items() if (p := _identity(i.forward)) is not None
    }
    if base not in infos or not identities:
        return []
    built = _built(infos[base], set(infos))
    targets = {
        a: identities[c]
        for a, c in built.items()
        if c in identities and _only_called(infos[base], a)
    }
    if not targets:
        return []
    params = {a: _positions(infos[built[a]].forward) for a in targets}
    swapped = cst.parse_module(pieces[base]).visit(_Unwrap(targets, params))
    gone = sorted(a for a in targets if not _reads(swapped, a))
    if not gone:
        return []
    pieces[base] = code(swapped.visit(_DropBuilt(set(gone))))
    return [Unbuilt(a, built[a], targets[a], folded_in.get(built[a], {})) for a in gone]


def _infos(pieces: dict[str, str]) -> dict[str, ClassInfo]:
    return {n: i for n, t in pieces.items() if (i := class_info(t)) is not None}


def _built(info: ClassInfo, classes: set[str]) -> dict[str, str]:
    """`attr -> class` for each `self.<attr>` built once, as one of `classes` (on the
    ranks that hold it: a pipeline guard's `PPMissingLayer()` aside)."""
    out = {}
    for attr, values in info.choices.items():
        values = [
            v for v in values if not m.matches(v, m.Call(m.Name("PPMissingLayer")))
        ]
        if len(values) == 1 and m.matches(values[0], m.Call(func=m.Name())):
            if values[0].func.value in classes:
                out[attr] = values[0].func.value
    return out


def _calls(infos: dict[str, ClassInfo]) -> dict[str, list[cst.Call]]:
    """{class: every `self.<attr>(...)` call of it}, for classes whose every use is
    such a call (an attribute built as it alone, read only to be called)."""
    calls: dict[str, list[cst.Call]] = {}
    built_count: dict[str, int] = {}
    named: dict[str, int] = {}
    unsure: set[str] = set()
    for info in infos.values():
        for name in m.findall(info.node, m.Name()):
            if name.value in infos and name.value != info.name:
                named[name.value] = named.get(name.value, 0) + 1
        for attr, cls in _built(info, set(infos)).items():
            if not _only_called(info, attr):
                unsure.add(cls)
                continue
            built_count[cls] = built_count.get(cls, 0) + 1
            call = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))
            calls.setdefault(cls, []).extend(m.findall(info.node, call))
    # a class named anywhere but in those constructions: its calls are not all seen
    return {
        c: found
        for c, found in calls.items()
        if found and c not in unsure and named.get(c) == built_count[c]
    }


def _only_called(info: ClassInfo, attr: str) -> bool:
    """Every read of `self.<attr>` in the class is the callee of a call: it is never
    handed on, so its calls are all its uses."""
    return not _reads(info.node, attr, called=False)


def _reads(node: cst.CSTNode, attr: str, called: bool = True) -> list:
    """Reads of `self.<attr>` that are not assignment targets (with `called` False:
    nor callees of a call)."""
    skip = {
        id(t.target)
        for t in m.findall(node, m.AssignTarget(m.Attribute(value=m.Name("self"))))
    }
    if not called:
        skip |= {
            id(c.func)
            for c in m.findall(node, m.Call(func=m.Attribute(value=m.Name("self"))))
        }
    return [
        a
        for a in m.findall(node, m.Attribute(value=m.Name("self"), attr=m.Name(attr)))
        if id(a) not in skip
    ]


def _positions(forward: cst.FunctionDef) -> list[str]:
    return [p.name.value for p in forward.params.params if p.name.value != "self"]


def _passed(call: cst.Call, params: list[str]) -> dict[str, cst.BaseExpression] | None:
    """{parameter: what `call` passes for it}, or None through `*args` / `**kwargs`."""
    if any(a.star for a in call.args):
        return None
    return {
        p: value for p in params if (value := passed_for(call, params, p)) is not None
    }


def _constants(forward: cst.FunctionDef | None, calls: list[cst.Call]) -> dict:
    """{parameter: the literal every call passes for it}."""
    if forward is None or not calls:
        return {}
    params = _positions(forward)
    passed = [_passed(c, params) for c in calls]
    if any(p is None for p in passed):
        return {}
    out = {}
    for p in params:
        values = {code(d[p]) if p in d else None for d in passed}
        if len(values) != 1 or None in values:
            continue
        if not is_constant(passed[0][p]):
            continue
        out[p] = values.pop()
    return out


_NO_GRAD = m.With(
    items=[
        m.WithItem(
            item=m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("no_grad")))
        )
    ]
)


def _identity(forward: cst.FunctionDef | None) -> str | None:
    """The parameter a forward returns unchanged when that is all it does (what it
    computes before only binds locals nothing reads, through calls that change
    nothing: `pure_calls`)."""
    if forward is None:
        return None
    body = [s for s in forward.body.body if not is_docstring(s)]
    if not body or not m.matches(
        body[-1], m.SimpleStatementLine([m.Return(value=m.Name())])
    ):
        return None
    name = body[-1].body[0].value.value
    if name not in _positions(forward):
        return None
    pure = PureCalls(set(), {}, {})
    for stmt in body[:-1]:
        for s in stmt.body.body if m.matches(stmt, _NO_GRAD) else [stmt]:
            bound = _local_stores(s)
            # only new locals: neither the returned name nor an item of an input
            if bound is None or name in bound or any(b[0] == "[" for b in bound):
                return None
            if not pure.holds(s):
                return None
    return name


class _Replace(cst.CSTTransformer):
    def __init__(self, old: cst.FunctionDef, new: cst.FunctionDef):
        self.old, self.new = old, new

    def leave_FunctionDef(self, original, updated):
        return self.new if original.deep_equals(self.old) else updated


class _Unwrap(cst.CSTTransformer):
    """`self.<attr>(...)` of an identity module -> what the call passes it to return."""

    def __init__(self, targets: dict[str, str], params: dict[str, list[str]]):
        self.targets, self.params = targets, params

    def leave_Call(self, original, updated: cst.Call):
        f = updated.func
        if not m.matches(f, m.Attribute(value=m.Name("self"))):
            return updated
        attr = f.attr.value
        if attr not in self.targets:
            return updated
        passed = _passed(updated, self.params[attr])
        if passed is None or self.targets[attr] not in passed:
            return updated
        return passed[self.targets[attr]]

    def leave_SimpleStatementLine(self, original, updated):
        # `x = self.<identity>(..., x, ...)` became `x = x`
        if m.matches(
            updated,
            m.SimpleStatementLine([m.Assign(targets=[m.AssignTarget(m.Name())])]),
        ):
            assign = updated.body[0]
            if m.matches(assign.value, m.Name(assign.targets[0].target.value)):
                return cst.RemoveFromParent()
        return updated


class _DropBuilt(_DropConstructions):
    """`self.<attr> = ...` for `attrs`, and a pipeline guard left holding nothing
    else (`if get_pp_group().is_first_rank: ... else: self.x = PPMissingLayer()`)."""

    def leave_If(self, original, updated):
        blocks = [original.body]
        if isinstance(original.orelse, cst.Else):
            blocks.append(original.orelse.body)
        if all(all(self.builds(s) for s in b.body) for b in blocks):
            return cst.RemoveFromParent()
        return updated
