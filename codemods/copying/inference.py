"""What vLLM's inference folds away in a copied function: the cache, output and
training parameters (their values folded into the body, simplify.py), and annotations
naming transformers' own types."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from .simplify import INFERENCE_PARAMS, loads, simplify_function

# annotation names the copy keeps (others name transformers' types: dropped)
ANNOTATION_NAMES = {
    "torch",
    "nn",
    "int",
    "float",
    "bool",
    "str",
    "tuple",
    "list",
    "dict",
    "None",
    "type",
}


def _clean_annotation(ann: cst.Annotation | None) -> cst.Annotation | None:
    if ann is None:
        return None
    names = {n.value for n in m.findall(ann, m.Name())}
    attrs = {a.attr.value for a in m.findall(ann, m.Attribute())}
    if (names - attrs) <= ANNOTATION_NAMES and not m.findall(ann, m.SimpleString()):
        return ann
    return None


def clean_signature(func: cst.FunctionDef, drop: set[str]) -> cst.FunctionDef:
    """Drop the folded inference parameters and annotations naming transformers' types."""
    params = func.params

    def keep(p):
        return p.name.value not in drop

    def clean(p):
        return p.with_changes(annotation=_clean_annotation(p.annotation))

    new = params.with_changes(
        params=[clean(p) for p in params.params if keep(p)],
        kwonly_params=[clean(p) for p in params.kwonly_params if keep(p)],
        star_arg=(
            clean(params.star_arg)
            if isinstance(params.star_arg, cst.Param)
            else params.star_arg
        ),
        star_kwarg=(
            params.star_kwarg.with_changes(annotation=None)
            if params.star_kwarg
            else None
        ),
    )
    return func.with_changes(params=new, returns=_clean_annotation(func.returns))


def inference_values(func: cst.FunctionDef) -> dict[str, str]:
    """{parameter of `func` vLLM never passes: the source text of its value}."""
    names = {p.name.value for p in m.findall(func.params, m.Param())}
    return {k: v for k, v in INFERENCE_PARAMS.items() if k in names}


def inference_folded(func: cst.FunctionDef) -> cst.FunctionDef:
    """Fold the values of the parameters that carry nothing under vLLM into the body.

    The parameters stay in the signature (callers may pass them by position); calls no
    longer pass them by keyword, since every copied function folds its own."""
    known = inference_values(func)
    func = clean_signature(func, set())
    func = func.with_changes(body=func.body.visit(_DropInferenceKwargs()))
    return simplify_function(func, known)


def bind_unfolded(func: cst.FunctionDef, values: dict[str, str]) -> cst.FunctionDef:
    """A removed parameter still read (the function rebinds it on some path) starts
    as the value it always has."""
    read = set(loads(func.body))
    lines = [f"{k} = {v}" for k, v in values.items() if k in read]
    if not lines:
        return func
    stmts = [cst.parse_statement(line + "\n") for line in lines]
    body = list(func.body.body)
    at = 1 if body and is_docstring(body[0]) else 0
    return func.with_changes(
        body=func.body.with_changes(body=[*body[:at], *stmts, *body[at:]])
    )


class _DropInferenceKwargs(cst.CSTTransformer):
    """`self.x(..., past_key_values=..., use_cache=...)` -> without those keywords (the
    copied modules no longer take them)."""

    def leave_Call(self, original, updated: cst.Call):
        if not any(
            a.keyword is not None and a.keyword.value in INFERENCE_PARAMS
            for a in updated.args
        ):
            return updated
        func = updated.func
        is_module_call = isinstance(func, cst.Name) or m.matches(
            func, m.Attribute(value=m.Name("self"))
        )
        if not is_module_call:
            return updated
        args = [
            a
            for a in updated.args
            if a.keyword is None or a.keyword.value not in INFERENCE_PARAMS
        ]
        if args:
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(args=args)


def is_docstring(stmt) -> bool:
    return m.matches(
        stmt, m.SimpleStatementLine([m.Expr(m.SimpleString() | m.ConcatenatedString())])
    )
