"""Helpers the patterns' emitters share: source expressions, translated `__init__`
bodies. An emitter that meets something it cannot write raises `PatternRefused`: the
patterns emit while they claim, so that is a refusal, not a crash."""

from __future__ import annotations

import textwrap
from collections.abc import Callable

import libcst as cst
import libcst.matchers as m

from .base import ClassInfo, PatternRefused, code

# Extra constructor arguments every emitted module takes (its copied callers pass them,
# as they do to every class holding vLLM layers).
EXTRAS = ("quant_config", "prefix")
EXTRA_PARAMS = {
    "quant_config": "quant_config: QuantizationConfig | None = None",
    "prefix": 'prefix: str = ""',
}

# A translation of one `self.<attr> = ...` statement: the lines to emit in its place.
Translate = Callable[[str, cst.BaseExpression], "list[str] | None"]


def indent(lines: list[str], level: int = 2) -> str:
    return textwrap.indent("\n".join(lines), "    " * level)


def source_params(info: ClassInfo, drop: tuple[str, ...] = ()) -> list[str]:
    """The class's `__init__` parameters after `self`, as written (annotations kept)."""
    if info.init is None:
        return []
    params = info.init.params
    if (
        params.star_arg not in (cst.MaybeSentinel.DEFAULT, None)
        or params.star_kwarg
        or params.kwonly_params
    ):
        raise PatternRefused(
            f"{info.name}.__init__ takes *args/**kwargs or keyword-only arguments"
        )
    # Annotations are dropped: they may name source-only imports (e.g. the config class).
    kept = [p for p in params.params if p.name.value not in ("self", *drop)]
    return [p.name.value + (f"={code(p.default)}" if p.default else "") for p in kept]


def signature(info: ClassInfo, drop: tuple[str, ...] = ()) -> str:
    return ", ".join(
        ["self", *source_params(info, drop), *(EXTRA_PARAMS[e] for e in EXTRAS)]
    )


def with_extras(call: cst.Call, extras: tuple[str, ...], attr: str) -> str:
    """`Cls(args)` -> `Cls(args, cache_config=cache_config, ..., prefix=f"{prefix}.<attr>")`."""
    args = [code(a).rstrip(", ") for a in call.args]
    for extra in extras:
        args.append(
            f'prefix=f"{{prefix}}.{attr}"' if extra == "prefix" else f"{extra}={extra}"
        )
    return f"{code(call.func)}({', '.join(args)})"


def translate_init(
    info: ClassInfo, translate: Translate, prologue: tuple[str, ...] = ()
) -> list[str]:
    """The source `__init__` body, statement by statement, with `self.<attr> = <value>`
    statements replaced by what `translate` returns (None keeps the statement as is).
    Docstrings are dropped; everything else is kept verbatim, so plain attributes the
    source computes (head_dim, scaling, sliding window, ...) are computed the same way.
    `prologue` lines go right after `super().__init__()`."""
    out: list[str] = []
    for stmt in info.init_statements():
        if m.matches(
            stmt,
            m.SimpleStatementLine(
                [m.Expr(m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")))))]
            ),
        ):
            out.append("super().__init__()")
            out.extend(prologue)
            continue
        out.extend(_translate_statement(stmt, translate))
    return out


def _translate_statement(stmt: cst.BaseStatement, translate: Translate) -> list[str]:
    """One statement; the branches of an `if` are translated too (a layer that builds a
    MoE block on some layers and a dense MLP on the others)."""
    if isinstance(stmt, cst.If):
        return _translate_if(stmt, translate, "if")
    if m.matches(
        stmt,
        m.SimpleStatementLine([m.Expr(m.SimpleString() | m.ConcatenatedString())]),
    ):
        return []
    if m.matches(
        stmt,
        m.SimpleStatementLine(
            [m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))])]
        ),
    ):
        assign = stmt.body[0]
        lines = translate(assign.targets[0].target.attr.value, assign.value)
        if lines is not None:
            return lines
    return code(stmt).strip("\n").splitlines()


def _translate_if(node: cst.If, translate: Translate, keyword: str) -> list[str]:
    out = [f"{keyword} {code(node.test)}:"]
    for stmt in node.body.body:
        out += ["    " + line for line in _translate_statement(stmt, translate)]
    if isinstance(node.orelse, cst.If):
        out += _translate_if(node.orelse, translate, "elif")
    elif isinstance(node.orelse, cst.Else):
        out.append("else:")
        for stmt in node.orelse.body.body:
            out += ["    " + line for line in _translate_statement(stmt, translate)]
    return out


def returned_arity(info: ClassInfo) -> int:
    """How many values the source's forward returns (`return out, weights`: 2)."""
    returns = m.findall(info.forward, m.Return())
    sizes = {
        len(r.value.elements) if isinstance(r.value, cst.Tuple) else 1
        for r in returns
        if r.value is not None
    }
    if len(sizes) != 1:
        raise PatternRefused(f"{info.name}.forward returns values of several arities")
    return sizes.pop()


def positions_call(call: cst.Call, arity: int) -> cst.BaseExpression:
    """A copied caller's `self.<attr>(hidden_states=h, <the source's other inputs>)` ->
    `self.<attr>(positions, h)` for a module in vLLM's layout (it returns one tensor;
    where the source returned more, Nones stand in for the rest)."""
    hidden = [
        a.value
        for a in call.args
        if not a.star and (a.keyword is None or a.keyword.value == "hidden_states")
    ]
    if not hidden:
        raise PatternRefused(f"`{code(call)}` passes no hidden states")
    native = cst.parse_expression(f"{code(call.func)}(positions, {code(hidden[0])})")
    if arity == 1:
        return native
    return cst.Tuple(
        [cst.Element(native)]
        + [cst.Element(cst.Name("None")) for _ in range(arity - 1)]
    )


def with_keyword(call: cst.Call, name: str, value: str) -> cst.Call:
    """`f(a, **kw)` -> `f(a, <name>=<value>, **kw)`."""
    args = list(call.args)
    at = next((i for i, a in enumerate(args) if a.star == "**"), len(args))
    new = cst.Arg(
        cst.parse_expression(value),
        keyword=cst.Name(name),
        equal=cst.AssignEqual(
            whitespace_before=cst.SimpleWhitespace(""),
            whitespace_after=cst.SimpleWhitespace(""),
        ),
    )
    if at > 0:
        args[at - 1] = args[at - 1].with_changes(
            comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        )
    if at < len(args):
        new = new.with_changes(
            comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        )
    args.insert(at, new)
    return call.with_changes(args=args)


class DefaultNone(cst.CSTTransformer):
    """`name=None` for the forward parameters in `names` that have no default (a caller
    no longer passes them)."""

    def __init__(self, names: set[str]):
        self.names = names

    def leave_FunctionDef(self, original, updated: cst.FunctionDef):
        if updated.name.value != "forward":
            return updated
        params = list(updated.params.params)
        if not any(p.name.value in self.names and p.default is None for p in params):
            return updated
        # once one parameter has a default, every later positional one needs one
        out, defaulted = [], False
        for p in params:
            if p.default is None and (defaulted or p.name.value in self.names):
                if p.name.value != "self":
                    p = p.with_changes(
                        default=cst.Name("None"),
                        equal=cst.AssignEqual(
                            whitespace_before=cst.SimpleWhitespace(""),
                            whitespace_after=cst.SimpleWhitespace(""),
                        ),
                    )
            defaulted = defaulted or p.default is not None
            out.append(p)
        return updated.with_changes(params=updated.params.with_changes(params=out))
