"""q/k/v projections of one input -> `QKVParallelLinear`.

Matched on the attention class: three `nn.Linear` attributes called on the same name in
`forward`, whose results reach the attention call as its query, key and value arguments
(roles read from that call, not from the attribute names). The head arithmetic the
merged layer needs (heads, kv heads, head size) is read from the projections' output
sizes, `<heads> * self.<head_dim>`, so it is whatever the source says it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from .base import (
    ClassInfo,
    FusionRecord,
    PatternRefused,
    Refusal,
    code,
    is_linear,
    linear_args,
    self_attr,
)
from .rms_norm import NormSpec, is_norm_call

NAME = "qkv"
VLLM_CLASS = "QKVParallelLinear"

# attention_interface(self, q, k, v, mask, ...): the call that consumes the projections.
ATTENTION_CALL = m.Call(
    args=[
        m.Arg(m.Name("self")),
        m.Arg(m.SaveMatchedNode(m.Name(), "q")),
        m.Arg(m.SaveMatchedNode(m.Name(), "k")),
        m.Arg(m.SaveMatchedNode(m.Name(), "v")),
        m.ZeroOrMore(),
    ]
)
# Tensor methods that only change the layout between a projection and the attention call.
LAYOUT_METHODS = {"view", "reshape", "transpose", "contiguous"}


@dataclass(frozen=True)
class HeadNorm:
    attr: str
    size: cst.BaseExpression
    eps: cst.BaseExpression | None
    spec: NormSpec


@dataclass(frozen=True)
class QKVSpec:
    class_name: str
    projections: tuple[str, str, str]  # (q, k, v) attribute names, in role order
    merged: str
    out_proj: str
    hidden_size: cst.BaseExpression
    head_dim_attr: str
    num_heads: cst.BaseExpression
    num_kv_heads: cst.BaseExpression
    bias: cst.BaseExpression
    out_args: tuple[cst.BaseExpression, cst.BaseExpression, cst.BaseExpression]
    q_norm: HeadNorm | None
    k_norm: HeadNorm | None
    # keyword arguments of the attention call, as written in the source
    call_kwargs: dict[str, cst.BaseExpression]


def merged_name(projections: tuple[str, ...], sep: str = "") -> str:
    """`q_proj, k_proj, v_proj` -> `qkv_proj`; `gate_proj, up_proj` -> `gate_up_proj`."""
    suffix = "_proj" if all(p.endswith("_proj") for p in projections) else ""
    stems = [p[: len(p) - len(suffix)] if suffix else p for p in projections]
    return sep.join(stems) + (suffix or "_merged")


def _assignment_of(forward: cst.FunctionDef, name: str) -> cst.BaseExpression:
    """The value of the last `name = ...` (single target) before the attention call."""
    found = m.findall(
        forward,
        m.Assign(targets=[m.AssignTarget(target=m.Name(name))]),
    )
    if not found:
        raise PatternRefused(f"{name} is not assigned in forward")
    return found[0].value


def _unwrap(value: cst.BaseExpression, info: ClassInfo, norms: dict[str, NormSpec]):
    """Peel layout methods and a head norm off one q/k/v expression.

    Returns (projection attr, input name, norm attr or None, norm applied per head)."""
    norm_attr, per_head = None, False
    node = value
    while True:
        if m.matches(node, m.Call(func=m.Attribute(attr=m.Name()))) and not m.matches(
            node.func, self_attr()
        ):
            method = node.func.attr.value
            if method not in LAYOUT_METHODS:
                raise PatternRefused(f"`.{method}(...)` between a projection and attention")
            node = node.func.value
            continue
        if m.matches(node, m.Call(func=self_attr(), args=[m.Arg()])):
            attr = node.func.attr.value
            arg = node.args[0].value
            if is_linear(info, attr):
                if not isinstance(arg, cst.Name):
                    raise PatternRefused(f"self.{attr} is not applied to a plain name")
                return attr, arg.value, norm_attr, per_head
            if norm_attr is None and is_norm_call(info.attrs.get(attr), norms):
                norm_attr = attr
                per_head = m.matches(arg, m.Call(func=m.Attribute(attr=m.Name("view") | m.Name("reshape"))))
                node = arg
                continue
            raise PatternRefused(f"self.{attr}(...) between a projection and attention")
        raise PatternRefused(f"`{code(node)}` between a projection and attention")


def match(info: ClassInfo, norms: dict[str, NormSpec]) -> QKVSpec | Refusal | None:
    if info.forward is None:
        return None
    calls = m.findall(info.forward, ATTENTION_CALL)
    if not calls:
        return None
    try:
        return _extract(info, norms, calls[0])
    except PatternRefused as why:
        return Refusal(NAME, info.name, "q/k/v projections", str(why))


def _extract(info: ClassInfo, norms: dict[str, NormSpec], call: cst.Call) -> QKVSpec:
    roles = m.extract(call, ATTENTION_CALL)
    unwrapped = []
    for role in ("q", "k", "v"):
        unwrapped.append(_unwrap(_assignment_of(info.forward, roles[role].value), info, norms))
    projections = tuple(u[0] for u in unwrapped)
    if len(set(projections)) != 3:
        raise PatternRefused("query, key and value do not come from three distinct projections")
    inputs = {u[1] for u in unwrapped}
    if len(inputs) != 1:
        raise PatternRefused(f"the projections read different tensors ({', '.join(sorted(inputs))})")
    if unwrapped[2][2] is not None:
        raise PatternRefused("a norm on the value projection")

    args = [linear_args(info.attrs[p]) for p in projections]
    hidden = {code(a[0]) for a in args}
    biases = {code(a[2]) for a in args}
    if len(hidden) != 1:
        raise PatternRefused("the projections have different input sizes")
    if len(biases) != 1:
        raise PatternRefused(f"bias differs between the projections ({', '.join(sorted(biases))})")

    heads, head_dims = [], set()
    for out in (a[1] for a in args):
        if not m.matches(out, m.BinaryOperation(operator=m.Multiply(), right=self_attr())):
            raise PatternRefused(f"output size `{code(out)}` is not `<heads> * self.<head_dim>`")
        heads.append(out.left)
        head_dims.add(out.right.attr.value)
    if len(head_dims) != 1 or code(heads[1]) != code(heads[2]):
        raise PatternRefused("key and value do not share one head layout")

    head_norms = []
    for (_, _, norm_attr, per_head), role in zip(unwrapped[:2], "qk"):
        if norm_attr is None:
            head_norms.append(None)
            continue
        if not per_head:
            raise PatternRefused(
                f"{role}-norm over the whole projection needs a cross-rank reduction under TP"
            )
        spec = norms[info.constructed_class(norm_attr)]
        size, eps = spec.bind(info.attrs[norm_attr])
        head_norms.append(HeadNorm(norm_attr, size, eps, spec))

    used = set(projections)
    outs = [
        a
        for a in info.attrs
        if is_linear(info, a) and a not in used and m.findall(info.forward, m.Call(func=self_attr(a)))
    ]
    if len(outs) != 1:
        raise PatternRefused("no single output projection after attention")

    return QKVSpec(
        class_name=info.name,
        projections=projections,
        merged=merged_name(projections),
        out_proj=outs[0],
        hidden_size=args[0][0],
        head_dim_attr=head_dims.pop(),
        num_heads=heads[0],
        num_kv_heads=heads[1],
        bias=args[0][2],
        out_args=linear_args(info.attrs[outs[0]]),
        q_norm=head_norms[0],
        k_norm=head_norms[1],
        call_kwargs={a.keyword.value: a.value for a in call.args if a.keyword is not None},
    )


def records(spec: QKVSpec, scope: str) -> list[FusionRecord]:
    out = [
        FusionRecord(NAME, spec.class_name, spec.projections, spec.merged, VLLM_CLASS, ("q", "k", "v"), scope)
    ]
    for norm in (spec.q_norm, spec.k_norm):
        if norm is not None:
            out.append(FusionRecord("rms_norm", spec.class_name, (norm.attr,), norm.attr, norm.spec.vllm_class))
    return out
