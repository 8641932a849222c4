"""Constructor guards that the arguments a model passes decide, whatever the config.

`branches` follows a construction whose guard reads a config field; a guard can also
read a constructor parameter that every construction reachable from the causal LM
fixes to a constant. Moshi's decoder layer takes `use_flexible_linear`: its text model
passes False, its depth decoder (another model, not built by the causal LM) True, and
the layer's MLP builds `MoshiFlexibleLinear` only on the True side, whatever
`num_codebooks` says. Such a construction is not a kind the causal LM can build.

Values are sets of constants, None where unknown: a guard is decided only when every
value it can take is a constant.
"""

from __future__ import annotations

import itertools
import operator

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, dotted_name

from .branches import _params
from .branches import _passed as passed_for

_CONSTANTS = {"True": True, "False": False, "None": None}
_COMPARE = {
    cst.Equal: operator.eq,
    cst.NotEqual: operator.ne,
    cst.Is: operator.is_,
    cst.IsNot: operator.is_not,
}


def _passed(call: cst.Call, params: list[str], name: str):
    """What `call` passes for `name` (None: nothing; `...`: unknown, through `*args` /
    `**kwargs`)."""
    named = any(a.keyword is not None and a.keyword.value == name for a in call.args)
    if not named and any(a.star for a in call.args):
        return ...  # unknown: `*args` / `**kwargs` may carry it
    return passed_for(call, params, name)


class FixedArguments:
    """What the constructions inside `callers` pass each class's parameters."""

    def __init__(self, classes: dict[str, ClassInfo], callers: set[str]):
        self.classes = classes
        self.callers = callers
        self._seen: set[tuple[str, str]] = set()

    def values(self, owner: str, param: str) -> set | None:
        """The constants every construction of `owner` in `callers` passes for
        `param` (its default where a construction passes nothing), or None."""
        key = (owner, param)
        if key in self._seen:
            return None  # a cycle: unknown
        self._seen.add(key)
        try:
            return self._values(owner, param)
        finally:
            self._seen.discard(key)

    def _values(self, owner: str, param: str) -> set | None:
        info = self.classes.get(owner)
        if info is None or info.init is None:
            return None
        params = _params(info)
        default = next(
            (p.default for p in info.init.params.params if p.name.value == param),
            None,
        )
        out: set = set()
        found = False
        for name in self.callers:
            caller = self.classes.get(name)
            if caller is None or caller.init is None:
                continue
            for call in m.findall(caller.init, m.Call()):
                if dotted_name(call.func) != owner:
                    continue
                found = True
                expr = _passed(call, params, param)
                if expr is ...:
                    return None
                expr = default if expr is None else expr
                got = self.evaluate(expr, name, {}) if expr is not None else None
                if got is None:
                    return None
                out |= got
        return out if found else None

    def evaluate(self, expr, owner: str, bindings: dict) -> set | None:
        """The values `expr` can take inside `owner.__init__` (`bindings`: its earlier
        assignments), or None where any of them is unknown."""
        if isinstance(expr, cst.Name):
            if expr.value in _CONSTANTS:
                return {_CONSTANTS[expr.value]}
            if expr.value in bindings:
                bound = bindings[expr.value]
                return self.evaluate(
                    bound, owner, {k: v for k, v in bindings.items() if k != expr.value}
                )
            info = self.classes.get(owner)
            if info is not None and expr.value in _params(info):
                return self.values(owner, expr.value)
            return None
        if isinstance(expr, cst.Integer):
            return {int(expr.value)}
        if isinstance(expr, cst.SimpleString):
            return {expr.evaluated_value}
        if m.matches(expr, m.Attribute(value=m.Name("self"))):
            key = f"self.{expr.attr.value}"
            if key in bindings:
                rest = {k: v for k, v in bindings.items() if k != key}
                return self.evaluate(bindings[key], owner, rest)
            return None
        if isinstance(expr, cst.UnaryOperation) and isinstance(expr.operator, cst.Not):
            inner = self.evaluate(expr.expression, owner, bindings)
            return None if inner is None else {not v for v in inner}
        if isinstance(expr, cst.IfExp):
            test = self.evaluate(expr.test, owner, bindings)
            if test is None:
                return None
            out: set = set()
            for branch, taken in ((expr.body, True), (expr.orelse, False)):
                if any(bool(v) is taken for v in test):
                    got = self.evaluate(branch, owner, bindings)
                    if got is None:
                        return None
                    out |= got
            return out
        if isinstance(expr, cst.BooleanOperation):
            left = self.evaluate(expr.left, owner, bindings)
            right = self.evaluate(expr.right, owner, bindings)
            if left is None or right is None:
                return None
            both = isinstance(expr.operator, cst.And)
            return {
                (a and b) if both else (a or b)
                for a, b in itertools.product(left, right)
            }
        if isinstance(expr, cst.Comparison) and len(expr.comparisons) == 1:
            target = expr.comparisons[0]
            compare = _COMPARE.get(type(target.operator))
            left = self.evaluate(expr.left, owner, bindings)
            right = self.evaluate(target.comparator, owner, bindings)
            if compare is None or left is None or right is None:
                return None
            return {compare(a, b) for a, b in itertools.product(left, right)}
        return None

    def never_taken(self, site) -> bool:
        """Some guard of `site` (a `branches.Site`) is decided against it (through
        the names its `__init__` assigns once)."""
        info = self.classes.get(site.owner)
        once = _assigned_once(info.init) if info is not None and info.init else set()
        bindings = {k: v for k, v in site.bindings.items() if k in once}
        for guard in site.guards:
            got = self.evaluate(guard.test, site.owner, bindings)
            if got is not None and all(bool(v) is guard.negated for v in got):
                return True
        return False


def _assigned_once(init: cst.FunctionDef) -> set[str]:
    """Locals and `self.` attributes `init` assigns exactly once."""
    seen: list[str] = []
    for node in m.findall(init, m.Assign() | m.AugAssign() | m.AnnAssign()):
        targets = (
            [t.target for t in node.targets]
            if isinstance(node, cst.Assign)
            else [node.target]
        )
        for t in targets:
            if isinstance(t, cst.Name):
                seen.append(t.value)
            elif m.matches(t, m.Attribute(value=m.Name("self"))):
                seen.append(f"self.{t.attr.value}")
            else:  # a tuple target: its names are not single values
                seen += [n.value for n in m.findall(t, m.Name())] * 2
    return {n for n in seen if seen.count(n) == 1}
