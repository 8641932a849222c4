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

from ..base import (
    ClassInfo,
    chunk_call,
    FusionRecord,
    PatternRefused,
    Refusal,
    code,
    is_linear,
    linear_args,
    self_attr,
)
from ..rms_norm import NormSpec

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
    norm_class: str
    spec: (
        NormSpec | None
    )  # None: a norm class the rms_norm pattern refused (copied as is)
    # per head (Qwen3, Gemma 3), or over the whole projection (OLMo 2), which under TP
    # is gathered across ranks, normed, and split again
    per_head: bool = True


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
    # one projection already packed [q; k; v] in the checkpoint, sliced in forward
    # (Phi-3): `projections` names it three times, its weight loader splits it
    packed: bool = False
    # packed per head instead, [q_h; k_h; v_h] for each head h (GPT-NeoX): reordered to
    # [q; k; v] when the checkpoint is loaded
    interleaved: bool = False


def merged_name(projections: tuple[str, ...], sep: str = "") -> str:
    """`q_proj, k_proj, v_proj` -> `qkv_proj`; `gate_proj, up_proj` -> `gate_up_proj`."""
    suffix = "_proj" if all(p.endswith("_proj") for p in projections) else ""
    stems = [p[: len(p) - len(suffix)] if suffix else p for p in projections]
    return sep.join(stems) + (suffix or "_merged")


def _assignment_of(forward: cst.FunctionDef, name: str) -> cst.BaseExpression:
    """The expression `name` holds at the attention call: its single-target assignments
    in order, each later one that reads `name` composed with the one before
    (`q = self.q_proj(x).view(s)`, `q = self.q_norm(q)` -> `self.q_norm(self.q_proj(x).view(s))`).
    Tuple assignments (the rotary call) are left to the proof."""
    found = _assignments(forward, name)
    value = found[0].value
    for later in found[1:]:
        if not m.findall(later.value, m.Name(name)):
            raise PatternRefused(f"{name} is assigned twice")
        value = later.value.visit(_Substitute(name, value))
    return value


def _assignments(forward: cst.FunctionDef, name: str) -> list[cst.Assign]:
    """`name = ...` statements of `forward`, in order (at least one)."""
    found = m.findall(forward, m.Assign(targets=[m.AssignTarget(target=m.Name(name))]))
    if not found:
        raise PatternRefused(f"{name} is not assigned in forward")
    return found


def _head_size_attr(info: ClassInfo) -> str | None:
    """The one attribute `__init__` names as the head size (`self.head_dim`)."""
    found = [a for a in info.attrs if "head_dim" in a or a.endswith("head_size")]
    return found[0] if len(found) == 1 else None


def _as_attr(info: ClassInfo, width: cst.BaseExpression) -> cst.BaseExpression:
    """`width` as the attribute `__init__` stores it in (`embed_dim` ->
    `self.embed_dim`), readable on the module as well as in `__init__`."""
    for attr, value in info.attrs.items():
        if code(value) == code(width):
            return cst.parse_expression(f"self.{attr}")
    if isinstance(width, (cst.Name, cst.Attribute)):
        return width
    return width.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def _aliased(forward: cst.FunctionDef, name: str) -> str:
    """The name `name` stands for where it is assigned once, from another name
    (BioGPT's `current_states = hidden_states`, its cross-attention folded away)."""
    for _ in range(8):
        found = m.findall(
            forward, m.Assign(targets=[m.AssignTarget(target=m.Name(name))])
        )
        if len(found) != 1 or not isinstance(found[0].value, cst.Name):
            return name
        name = found[0].value.value
    return name


class _Substitute(cst.CSTTransformer):
    def __init__(self, name: str, value: cst.BaseExpression):
        self.name, self.value = name, value

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        return self.value if original.value == self.name else updated


def _unwrap(
    value: cst.BaseExpression, info: ClassInfo, norms: dict[str, NormSpec | None]
):
    """Peel layout methods, a head norm and a slice of a packed projection off one
    q/k/v expression.

    Returns (projection attr, input name, norm attr or None, norm applied per head,
    sliced out of a packed projection)."""
    norm_attr, per_head = None, False
    node = value
    while True:
        if m.matches(node, m.Subscript(value=m.Name())):
            # `qkv[..., a:b]` with `qkv = self.<packed>(x)`: the slice bounds are left
            # to the proof, which checks the [q; k; v] layout numerically
            packed = _assignment_of(info.forward, node.value.value)
            if not m.matches(
                packed, m.Call(func=self_attr(), args=[m.Arg(m.Name())])
            ) or not is_linear(info, packed.func.attr.value):
                raise PatternRefused(
                    f"`{code(node)}` does not slice one projection's output"
                )
            attr = packed.func.attr.value
            return attr, packed.args[0].value.value, norm_attr, per_head, True
        if m.matches(node, m.Call(func=m.Attribute(attr=m.Name()))) and not m.matches(
            node.func, self_attr()
        ):
            method = node.func.attr.value
            if method not in LAYOUT_METHODS:
                raise PatternRefused(
                    f"`.{method}(...)` between a projection and attention"
                )
            node = node.func.value
            continue
        if m.matches(node, m.Call(func=self_attr(), args=[m.Arg()])):
            attr = node.func.attr.value
            arg = node.args[0].value
            if is_linear(info, attr):
                if not isinstance(arg, cst.Name):
                    raise PatternRefused(f"self.{attr} is not applied to a plain name")
                return attr, arg.value, norm_attr, per_head, False
            if norm_attr is None and info.constructed_class(attr) in norms:
                norm_attr = attr
                # per head: the norm reads the projection split into heads (the
                # proof checks the numbers against a per-head norm)
                per_head = bool(
                    m.findall(
                        arg,
                        m.Call(
                            func=m.Attribute(attr=m.Name("view") | m.Name("reshape"))
                        ),
                    )
                )
                node = arg
                continue
            raise PatternRefused(f"self.{attr}(...) between a projection and attention")
        raise PatternRefused(f"`{code(node)}` between a projection and attention")


def match(
    info: ClassInfo, norms: dict[str, NormSpec | None], lenient: bool = False
) -> QKVSpec | Refusal | None:
    """`norms`: every norm-like class, with its spec where the rms_norm pattern matched.

    `lenient`: where a q/k/v name is rebuilt after its projection (Phi's partial rotary
    concatenates it again, Ministral 3 scales the query by position), read the
    projection and its input off the name's first assignment and leave what follows to
    the dataflow proof. Only a rewrite that keeps everything after the projections as
    the source has it (the merge of a copied attention) may ask for this."""
    if info.forward is None:
        return None
    calls = m.findall(info.forward, ATTENTION_CALL)
    if not calls:
        return None
    try:
        return _extract(info, norms, calls[0], lenient)
    except PatternRefused as why:
        return Refusal(NAME, info.name, "q/k/v projections", str(why))


def _extract(
    info: ClassInfo,
    norms: dict[str, NormSpec | None],
    call: cst.Call,
    lenient: bool = False,
) -> QKVSpec:
    roles = m.extract(call, ATTENTION_CALL)
    names = [roles[role].value for role in ("q", "k", "v")]
    interleaved = _interleaved(info, names)
    if interleaved is not None:
        return _interleaved_spec(info, call, *interleaved)
    unwrapped = []
    for name in names:
        try:
            unwrapped.append(_unwrap(_assignment_of(info.forward, name), info, norms))
        except PatternRefused as strict:
            if not lenient:
                raise
            try:
                first = _unwrap(_assignments(info.forward, name)[0].value, info, norms)
            except PatternRefused:
                raise strict from None  # the composed form says more
            unwrapped.append(first)
    projections = tuple(u[0] for u in unwrapped)
    sliced = {u[4] for u in unwrapped}
    packed = sliced == {True}
    if packed and len(set(projections)) != 1:
        raise PatternRefused(
            "query, key and value are sliced from different projections"
        )
    if not packed and len(set(projections)) != 3:
        raise PatternRefused(
            "query, key and value do not come from three distinct projections"
        )
    inputs = {_aliased(info.forward, u[1]) for u in unwrapped}
    if len(inputs) != 1:
        raise PatternRefused(
            f"the projections read different tensors ({', '.join(sorted(inputs))})"
        )
    if unwrapped[2][2] is not None:
        raise PatternRefused("a norm on the value projection")

    args = [linear_args(info.attrs[p]) for p in projections]
    hidden = {code(a[0]) for a in args}
    biases = {code(a[2]) for a in args}
    if len(hidden) != 1:
        raise PatternRefused("the projections have different input sizes")
    if len(biases) != 1:
        raise PatternRefused(
            f"bias differs between the projections ({', '.join(sorted(biases))})"
        )

    heads, head_dims = [], set()
    outs = _packed_sizes(info, args[0][1]) if packed else [a[1] for a in args]
    for out in outs:
        if m.matches(out, m.BinaryOperation(operator=m.Multiply(), right=self_attr())):
            heads.append(out.left)
            head_dims.add(out.right.attr.value)
        elif (size := _head_size_attr(info)) is not None:
            # a width (BioGPT's `embed_dim`): its heads are the width over the head
            # size; the merged GEMM's proof checks the counts on the tiny module
            heads.append(
                cst.BinaryOperation(
                    _as_attr(info, out),
                    cst.FloorDivide(),
                    cst.parse_expression(f"self.{size}"),
                )
            )
            head_dims.add(size)
        else:
            raise PatternRefused(
                f"output size `{code(out)}` is not `<heads> * self.<head_dim>`"
            )
    if len(head_dims) != 1 or code(heads[1]) != code(heads[2]):
        raise PatternRefused("key and value do not share one head layout")

    head_norms = []
    for (_, _, norm_attr, per_head, _), role in zip(unwrapped[:2], "qk"):
        if norm_attr is None:
            head_norms.append(None)
            continue
        norm_class = info.constructed_class(norm_attr)
        if not per_head:
            size = (
                info.attrs[norm_attr].args[0].value
                if info.attrs[norm_attr].args
                else None
            )
            out_size = args["qk".index(role)][1]
            if size is None or code(size) != code(out_size):
                raise PatternRefused(
                    f"{role}-norm over the whole projection is sized "
                    f"`{code(size) if size is not None else '?'}`, not `{code(out_size)}`"
                )
        head_norms.append(HeadNorm(norm_attr, norm_class, norms[norm_class], per_head))

    used = set(projections)
    outs = [
        a
        for a in info.attrs
        if is_linear(info, a)
        and a not in used
        and m.findall(info.forward, m.Call(func=self_attr(a)))
    ]
    if len(outs) != 1:
        raise PatternRefused("no single output projection after attention")

    return QKVSpec(
        class_name=info.name,
        projections=projections,
        merged=projections[0] if packed else merged_name(projections),
        out_proj=outs[0],
        hidden_size=args[0][0],
        head_dim_attr=head_dims.pop(),
        num_heads=heads[0],
        num_kv_heads=heads[1],
        bias=args[0][2],
        out_args=linear_args(info.attrs[outs[0]]),
        q_norm=head_norms[0],
        k_norm=head_norms[1],
        call_kwargs={
            a.keyword.value: a.value for a in call.args if a.keyword is not None
        },
        packed=packed,
    )


def _interleaved(info: ClassInfo, names: list[str]):
    """`q, k, v = y.chunk(3, dim=-1)` with `y = self.<packed>(x).view(..., 3 * self.<hd>)
    .transpose(...)`: one projection holding [q_h; k_h; v_h] per head. Returns (packed
    attr, input name, head-size attr), or None when q, k, v are not chunked so."""
    chunk = m.Assign(
        targets=[m.AssignTarget(m.Tuple([m.Element(m.Name(n)) for n in names]))],
        value=chunk_call(3),
    )
    found = m.findall(info.forward, chunk)
    if not found:
        return None
    node = _assignment_of(info.forward, found[0].value.func.value.value)
    head_size = None
    while m.matches(node, m.Call(func=m.Attribute(attr=m.Name()))) and not m.matches(
        node.func, self_attr()
    ):
        method = node.func.attr.value
        if method not in LAYOUT_METHODS:
            raise PatternRefused(f"`.{method}(...)` between a projection and attention")
        if method == "view" and node.args and isinstance(node.args[0].value, cst.Name):
            shape = _assignment_of(info.forward, node.args[0].value.value)
            per_head = m.findall(
                shape,
                m.BinaryOperation(
                    left=m.Integer("3"), operator=m.Multiply(), right=self_attr()
                ),
            )
            if per_head:
                head_size = per_head[0].right.attr.value
        node = node.func.value
    if not m.matches(node, m.Call(func=self_attr(), args=[m.Arg(m.Name())])):
        raise PatternRefused(f"`{code(node)}` is not one projection of the input")
    if head_size is None:
        raise PatternRefused(
            "the packed projection is not viewed as [..., 3 * head size]"
        )
    attr = node.func.attr.value
    if not is_linear(info, attr):
        raise PatternRefused(f"self.{attr} is not an nn.Linear")
    return attr, node.args[0].value.value, head_size


def _interleaved_spec(
    info: ClassInfo, call: cst.Call, attr: str, _input: str, head_size: str
) -> QKVSpec:
    hidden, out, bias = linear_args(info.attrs[attr])
    if not m.matches(
        out, m.BinaryOperation(left=m.Integer("3"), operator=m.Multiply())
    ):
        raise PatternRefused(f"packed output size `{code(out)}` is not `3 * <size>`")
    # as many kv heads as heads: the per-head packing holds one k and one v per head
    heads = cst.parse_expression(f"({code(out.right)}) // self.{head_size}")
    outs = [
        a
        for a in info.attrs
        if is_linear(info, a)
        and a != attr
        and m.findall(info.forward, m.Call(func=self_attr(a)))
    ]
    if len(outs) != 1:
        raise PatternRefused("no single output projection after attention")
    return QKVSpec(
        class_name=info.name,
        projections=(attr, attr, attr),
        merged=attr,
        out_proj=outs[0],
        hidden_size=hidden,
        head_dim_attr=head_size,
        num_heads=heads,
        num_kv_heads=heads,
        bias=bias,
        out_args=linear_args(info.attrs[outs[0]]),
        q_norm=None,
        k_norm=None,
        call_kwargs={
            a.keyword.value: a.value for a in call.args if a.keyword is not None
        },
        packed=True,
        interleaved=True,
    )


# <heads> * self.<hd> + 2 * (<kv heads> * self.<hd>)
_HEADS = m.BinaryOperation(operator=m.Multiply(), right=self_attr())
PACKED_SIZE = m.BinaryOperation(
    left=_HEADS,
    operator=m.Add(),
    right=m.BinaryOperation(left=m.Integer("2"), operator=m.Multiply(), right=_HEADS),
)


def _packed_sizes(info: ClassInfo, out: cst.BaseExpression) -> list:
    """[q, k, v] output sizes of a packed projection, from its size expression (or the
    local variable of `__init__` it names)."""
    if isinstance(out, cst.Name) and info.init is not None:
        found = m.findall(
            info.init, m.Assign(targets=[m.AssignTarget(m.Name(out.value))])
        )
        if found:
            out = found[-1].value
    if not m.matches(out, PACKED_SIZE):
        raise PatternRefused(
            f"packed output size `{code(out)}` is not `<heads> * self.<head_dim> + 2 * (<kv heads> * self.<head_dim>)`"
        )
    return [out.left, out.right.right, out.right.right]


def packed_text(spec: QKVSpec) -> str:
    if spec.interleaved:
        return "packed per head in the checkpoint, reordered at load"
    return "packed in the checkpoint" if spec.packed else ""


def records(spec: QKVSpec, scope: str, proven_norms: set[str]) -> list[FusionRecord]:
    # a packed checkpoint tensor stacks nothing: the weight loader splits it
    out = [
        FusionRecord(
            NAME,
            spec.class_name,
            (spec.merged,) if spec.packed else spec.projections,
            spec.merged,
            VLLM_CLASS,
            () if spec.packed else ("q", "k", "v"),
            scope,
            packed=packed_text(spec),
        )
    ]
    for norm in (spec.q_norm, spec.k_norm):
        if norm is not None and norm.norm_class in proven_norms:
            out.append(
                FusionRecord(
                    "rms_norm",
                    spec.class_name,
                    (norm.attr,),
                    norm.attr,
                    norm.spec.vllm_class,
                )
            )
    return out
