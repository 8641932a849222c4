"""Calls that change nothing but their result, so a statement made only of them can
be dropped when nothing reads what it binds.

Pure here: the tensor library's operators (`torch.<op>` of torch's op table, a
tensor method) but the in-place ones (`..._`, `out=`); `math`; a few builtins and
read-only container methods; the base model's parameter-free modules; and a function
or method of the generated file whose body only binds locals from such calls and
returns (BLOOM's `build_alibi_tensor`). A call to anything else (a module with
parameters or a cache, an unknown helper) is not.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
import torch

_BUILTINS = {"set", "dict", "list", "tuple", "len", "range", "enumerate", "zip"}
_BUILTINS |= {"int", "float", "bool", "min", "max", "abs", "slice", "isinstance"}
_CONTAINER_METHODS = {"copy", "get", "items", "keys", "values"}
# tensor methods not ending in `_` that still change state
_EFFECTFUL = {"backward", "register_hook", "retain_grad", "record_stream"}


def _op(name: str) -> bool:
    return not name.endswith("_") and name not in _EFFECTFUL


class PureCalls:
    def __init__(self, stateless: set[str], methods: dict, functions: dict):
        self.stateless, self.methods, self.functions = stateless, methods, functions
        self._seen: dict[int, bool] = {}

    def holds(self, node: cst.CSTNode) -> bool:
        """Every call `node` runs (not those inside a lambda it only defines) is pure."""
        lazy = {
            id(c)
            for lam in m.findall(node, m.Lambda())
            for c in m.findall(lam, m.Call())
        }
        return all(
            self._call(c) for c in m.findall(node, m.Call()) if id(c) not in lazy
        )

    def _call(self, call: cst.Call) -> bool:
        if any(a.keyword is not None and a.keyword.value == "out" for a in call.args):
            return False
        f = call.func
        if isinstance(f, cst.Name):
            if f.value in _BUILTINS:
                return True
            target = self.functions.get(f.value)
            return isinstance(target, cst.FunctionDef) and self._body(target)
        if not isinstance(f, cst.Attribute):
            return False
        name = f.attr.value
        if m.matches(f.value, m.Name("self")):
            if name in self.stateless:
                return True
            target = self.methods.get(name)
            return target is not None and self._body(target)
        if m.matches(f.value, m.Name("torch")):
            return _op(name) and hasattr(torch._C._VariableFunctions, name)
        if m.matches(f.value, m.Name("math")):
            return True
        if name in _CONTAINER_METHODS:
            return isinstance(f.value, cst.Name)
        # a method of a value (not of a module attribute): a tensor method
        return (
            not m.matches(f.value, m.Attribute(value=m.Name("self")))
            and _op(name)
            and hasattr(torch.Tensor, name)
        )

    def _body(self, func: cst.FunctionDef) -> bool:
        """A function that only binds locals from pure calls and returns."""
        key = id(func)
        if key not in self._seen:
            self._seen[key] = False  # a recursive call is not known pure
            self._seen[key] = not func.decorators and all(
                self._statement(s) for s in func.body.body
            )
        return self._seen[key]

    def _statement(self, stmt) -> bool:
        if isinstance(stmt, cst.SimpleStatementLine):
            return all(self._small(s) for s in stmt.body)
        if isinstance(stmt, cst.If):
            orelse = stmt.orelse
            return (
                self.holds(stmt.test)
                and self._block(stmt.body)
                and (
                    orelse is None
                    or (
                        self._statement(orelse)
                        if isinstance(orelse, cst.If)
                        else self._block(orelse.body)
                    )
                )
            )
        if isinstance(stmt, cst.For):
            return (
                stmt.orelse is None
                and _local(stmt.target)
                and self.holds(stmt.iter)
                and self._block(stmt.body)
            )
        return False

    def _block(self, block) -> bool:
        return all(self._statement(s) for s in block.body)

    def _small(self, small) -> bool:
        if isinstance(small, cst.Expr):
            return isinstance(small.value, (cst.SimpleString, cst.ConcatenatedString))
        if isinstance(small, cst.Pass):
            return True
        if isinstance(small, cst.Return):
            return small.value is None or self.holds(small.value)
        if isinstance(small, (cst.Assign, cst.AugAssign, cst.AnnAssign)):
            targets = (
                [t.target for t in small.targets]
                if isinstance(small, cst.Assign)
                else [small.target]
            )
            return all(_local(t) for t in targets) and (
                small.value is None or self.holds(small.value)
            )
        return False


def _local(target) -> bool:
    if isinstance(target, cst.Name):
        return True
    if isinstance(target, (cst.Tuple, cst.List)):
        return all(_local(e.value) for e in target.elements)
    return False
