"""A sparse MoE block (a top-k router and stacked experts) -> vLLM's fused MoE layer.

Matched on the classes the block builds from the source:

    router:   logits = <F>.linear(x, self.<weight>)           # weight [E, H]
              scores = softmax(logits) | sigmoid(logits)
              [+ self.<bias> for the choice; grouped: view(-1, self.<groups>, ...),
               torch.topk(group_scores, self.<topk_group>)]
              top, idx = torch.topk(scores, self.<top_k>, dim=-1)
              [if self.<flag>:] top /= top.sum(dim=-1, keepdim=True)
              [top = top * self.<scale>]
    experts:  self.<gate_up> = nn.Parameter(torch.empty(E, 2 * I, H))
              self.<down> = nn.Parameter(torch.empty(E, H, I))
              gate, up = <F>.linear(x, self.<gate_up>[e]).chunk(2, dim=-1)
              y = <F>.linear(self.<act>(gate) * up, self.<down>[e]) * weight
    block:    _, w, idx = self.<router>(x);  self.<experts>(x, idx, w)
              [+ self.<shared>(x): a dense gated MLP, the shared experts]

Each piece found becomes the matching argument of vLLM's `FusedMoEFactory` (scoring_func,
e_score_correction_bias, use_grouped_topk, routed_scaling_factor, renormalize). The proof
runs the block against vLLM's own routing function (`grouped_topk`) and the experts
written out, on the module's weights: a router that does anything else fails it and is
refused; it is never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from ..base import ClassInfo, FusionRecord, PatternRefused, Refusal, chunk_call, code
from ..glu import ACT2FN_LOOKUP

NAME = "moe"
VLLM_CLASS = "FusedMoE"

_PARAMETER = m.Call(
    func=m.Attribute(value=m.Name("nn"), attr=m.Name("Parameter"))
    | m.Name("Parameter"),
    args=[
        m.Arg(
            m.Call(
                func=m.Attribute(
                    value=m.Name("torch"),
                    attr=m.Name("empty") | m.Name("zeros") | m.Name("randn"),
                )
            )
        )
    ],
)
_LINEAR = m.Call(func=m.Attribute(attr=m.Name("linear")) | m.Name("linear"))
_SOFTMAX = m.Call(func=m.Attribute(attr=m.Name("softmax")) | m.Name("softmax"))
_SIGMOID = m.Call(func=m.Attribute(attr=m.Name("sigmoid")) | m.Name("sigmoid"))
_TOPK = m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("topk")))
# <t>.sum(dim=-1, keepdim=True)
_ROW_SUM = m.Call(
    func=m.Attribute(value=m.Name(), attr=m.Name("sum")),
    args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("keepdim")), m.ZeroOrMore()],
)
_RENORMALIZE = m.AugAssign(operator=m.DivideAssign()) | m.Assign(
    value=m.BinaryOperation(operator=m.Divide(), right=_ROW_SUM)
)
_SELF = m.Attribute(value=m.Name("self"))


@dataclass(frozen=True)
class RouterSpec:
    class_name: str
    weight: str
    top_k: cst.BaseExpression
    # `True` when renormalised unconditionally, `False` when not, else the flag's value
    renormalize: cst.BaseExpression
    # the router attribute the renormalisation is guarded by (its flag), if any
    flag: str | None
    scoring: str = "softmax"  # or "sigmoid"
    # score correction bias (added to the scores for the choice only), its attribute
    bias: str | None = None
    # grouped top-k: number of expert groups, groups kept per token
    groups: cst.BaseExpression | None = None
    topk_group: cst.BaseExpression | None = None
    # a factor on the chosen weights
    scale: cst.BaseExpression | None = None


@dataclass(frozen=True)
class ExpertsSpec:
    class_name: str
    gate_up: str
    down: str
    act_attr: str
    act_name: cst.BaseExpression
    num_experts: cst.BaseExpression
    intermediate: cst.BaseExpression
    hidden: cst.BaseExpression


@dataclass(frozen=True)
class MoESpec:
    class_name: str
    router_attr: str
    experts_attr: str
    router: RouterSpec
    experts: ExpertsSpec
    # sizes and switches, as expressions over the block's own constructor parameters
    num_experts: cst.BaseExpression
    top_k: cst.BaseExpression
    hidden: cst.BaseExpression
    intermediate: cst.BaseExpression
    renormalize: cst.BaseExpression
    activation: cst.BaseExpression
    # FusedMoE keyword arguments beyond the sizes (grouped top-k, scoring, ...), in the
    # block's names
    routing: tuple[tuple[str, str], ...] = ()
    # a dense MLP run on every token and added to the output (shared experts)
    shared_attr: str | None = None
    shared_class: str | None = None

    def describe_routing(self) -> str:
        renorm = code(self.renormalize)
        how = {"True": ", renormalised", "False": ""}.get(
            renorm, f", renormalised when `{renorm}`"
        )
        r = self.router
        extra = "".join(
            [
                ", with a score correction bias" if r.bias else "",
                (
                    f", in `{code(self.resolved('num_expert_group'))}` groups keeping `{code(self.resolved('topk_group'))}`"
                    if r.groups is not None
                    else ""
                ),
                (
                    f", scaled by `{code(self.resolved('routed_scaling_factor'))}`"
                    if r.scale is not None
                    else ""
                ),
                (
                    f", plus shared experts self.{self.shared_attr}"
                    if self.shared_attr
                    else ""
                ),
            ]
        )
        return f"{r.scoring} top-`{code(self.top_k)}` of `{code(self.num_experts)}` experts{how}{extra}"

    def resolved(self, key: str) -> cst.BaseExpression:
        return cst.parse_expression(dict(self.routing)[key])


# --- matching ------------------------------------------------------------------------


class _Resolve(cst.CSTTransformer):
    """`self.<attr>` -> the expression `__init__` assigned it; constructor parameters ->
    the arguments of the call that built the module: an expression in the builder's names.
    """

    def __init__(self, info: ClassInfo, args: dict[str, cst.BaseExpression]):
        self.info, self.args = info, args

    def leave_Attribute(self, original, updated):
        if m.matches(original, m.Attribute(value=m.Name("self"))):
            value = self.info.attrs.get(original.attr.value)
            if value is None:
                raise PatternRefused(
                    f"{self.info.name}.{original.attr.value} is not set in __init__"
                )
            return _grouped(resolve(value, self.info, self.args))
        return updated.with_changes(attr=original.attr)  # `x.<name>` is no parameter

    def leave_Arg(self, original, updated):
        return updated.with_changes(keyword=original.keyword)

    def leave_Name(self, original, updated):
        return self.args.get(original.value, updated)


_ATOMS = (cst.Name, cst.Attribute, cst.Call, cst.Subscript, cst.Integer, cst.Float)


def _grouped(expr: cst.BaseExpression) -> cst.BaseExpression:
    """An expression put where `self.<attr>` stood keeps its meaning: parenthesised
    unless it is an atom (`self.a * 2` with `a = b + c` is `(b + c) * 2`)."""
    if isinstance(expr, (*_ATOMS, cst.SimpleString)) or expr.lpar:
        return expr
    return expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def bind(info: ClassInfo, call: cst.Call) -> dict[str, cst.BaseExpression]:
    """{parameter: argument expression} of `call` to `info`'s constructor."""
    params = [p for p in info.init.params.params if p.name.value != "self"]
    out = {p.name.value: p.default for p in params if p.default is not None}
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    if len(positional) > len(params) or any(a.star for a in call.args):
        raise PatternRefused(
            f"{info.name}(...) is called with arguments it does not take"
        )
    out.update({p.name.value: v for p, v in zip(params, positional)})
    out.update({a.keyword.value: a.value for a in call.args if a.keyword is not None})
    return out


def resolve(
    expr: cst.BaseExpression, info: ClassInfo, args: dict[str, cst.BaseExpression]
) -> cst.BaseExpression:
    return expr.visit(_Resolve(info, args))


def _parameter_shape(info: ClassInfo, attr: str) -> list[cst.BaseExpression]:
    value = info.attrs.get(attr)
    if not m.matches(value, _PARAMETER):
        raise PatternRefused(f"self.{attr} is not an nn.Parameter(torch.empty(...))")
    return [a.value for a in value.args[0].value.args]


def _k_of(call: cst.Call) -> cst.BaseExpression | None:
    """The `k` of a `torch.topk(x, k, ...)` call."""
    for i, arg in enumerate(call.args):
        if (arg.keyword is None and i == 1) or (
            arg.keyword and arg.keyword.value == "k"
        ):
            return arg.value
    return None


def _unwrapped(node: cst.BaseExpression) -> cst.BaseExpression:
    """`self.w.type(torch.float32)` / `.float()` / `.to(...)` -> `self.w`."""
    while m.matches(
        node,
        m.Call(func=m.Attribute(attr=m.Name("type") | m.Name("float") | m.Name("to"))),
    ):
        node = node.func.value
    return node


def match_router(info: ClassInfo) -> RouterSpec | None:
    if info.forward is None:
        return None
    topks = m.findall(info.forward, _TOPK)
    if not topks:
        return None
    linears = m.findall(info.forward, _LINEAR)
    weight_arg = (
        _unwrapped(linears[0].args[1].value)
        if len(linears) == 1 and len(linears[0].args) > 1
        else None
    )
    if not m.matches(weight_arg, _SELF):
        raise PatternRefused("the router logits are not one linear of self.<weight>")
    weight = weight_arg.attr.value
    if len(_parameter_shape(info, weight)) != 2:
        raise PatternRefused(f"self.{weight} is not a 2-D [experts, hidden] parameter")
    softmax, sigmoid = (bool(m.findall(info.forward, f)) for f in (_SOFTMAX, _SIGMOID))
    if softmax == sigmoid:
        raise PatternRefused("the router scores neither with a softmax nor a sigmoid")
    ks = [_k_of(c) for c in topks]
    if len(ks) > 2 or not all(m.matches(k, _SELF) for k in ks):
        raise PatternRefused(
            "the router's top-k is not `torch.topk(..., self.<k>)`, once or per group"
        )
    groups = topk_group = None
    if len(ks) == 2:
        # grouped top-k: scores viewed as [tokens, self.<groups>, experts per group]
        views = m.findall(
            info.forward,
            m.Call(
                func=m.Attribute(attr=m.Name("view")),
                args=[m.Arg(), m.Arg(_SELF), m.Arg()],
            ),
        )
        if not views:
            raise PatternRefused(
                "two top-k calls but no [tokens, groups, experts] view"
            )
        groups, topk_group = views[0].args[1].value, ks[0]
    bias = scale = None
    for op in m.findall(info.forward, m.BinaryOperation(right=_SELF)):
        attr = op.right.attr.value
        if isinstance(op.operator, cst.Add) and m.matches(
            info.attrs.get(attr),
            m.Call(func=m.Attribute(attr=m.Name("Buffer") | m.Name("Parameter"))),
        ):
            bias = attr
        elif isinstance(op.operator, cst.Multiply):
            scale = op.right
    renormalize: cst.BaseExpression = cst.Name("False")
    flag = None
    for stmt in info.forward.body.body:
        if m.findall(stmt, _RENORMALIZE):
            if m.matches(stmt, m.If(test=_SELF)):
                if stmt.orelse is not None:
                    raise PatternRefused("the renormalisation has an else branch")
                flag = stmt.test.attr.value
                renormalize = cst.parse_expression(f"self.{flag}")
            elif isinstance(stmt, cst.If):
                raise PatternRefused(
                    f"the renormalisation is guarded by `{code(stmt.test)}`, not a self flag"
                )
            else:
                renormalize = cst.Name("True")
    return RouterSpec(
        class_name=info.name,
        weight=weight,
        top_k=ks[-1],
        renormalize=renormalize,
        flag=flag,
        scoring="sigmoid" if sigmoid else "softmax",
        bias=bias,
        groups=groups,
        topk_group=topk_group,
        scale=scale,
    )


def match_experts(info: ClassInfo) -> ExpertsSpec | None:
    if info.forward is None:
        return None
    # gate, up = <F>.linear(x, self.<gate_up>[e]).chunk(2, dim=-1)
    chunks = [
        c
        for c in m.findall(info.forward, m.Call(func=m.Attribute(attr=m.Name("chunk"))))
        if m.matches(c.func.value, _LINEAR)
    ]
    if not chunks:
        return None
    gate_up_call = chunks[0].func.value
    if not m.matches(
        chunks[0].with_changes(func=chunks[0].func.with_changes(value=cst.Name("y"))),
        chunk_call(2),
    ):
        raise PatternRefused(
            "the stacked gate/up output is not chunked in two on the last dim"
        )
    linears = m.findall(info.forward, _LINEAR)
    indexed = m.Subscript(value=m.Attribute(value=m.Name("self")))
    params = []
    for call in linears:
        if len(call.args) < 2 or not m.matches(call.args[1].value, indexed):
            raise PatternRefused(
                "an expert projection is not a linear of self.<param>[expert]"
            )
        params.append(call.args[1].value.value.attr.value)
    if len(params) != 2 or params[0] != gate_up_call.args[1].value.value.attr.value:
        raise PatternRefused(
            "the experts do not run one gate/up then one down projection"
        )
    gate_up, down = params
    acts = m.findall(
        info.forward,
        m.BinaryOperation(
            left=m.Call(func=m.Attribute(value=m.Name("self"))), operator=m.Multiply()
        ),
    )
    if len(acts) != 1:
        raise PatternRefused("no `self.<act>(gate) * up` product")
    act = acts[0].left.func.attr.value
    lookup = info.attrs.get(act)
    if not m.matches(lookup, ACT2FN_LOOKUP):
        raise PatternRefused(f"self.{act} is not an ACT2FN[...] activation")
    gu_shape, down_shape = _parameter_shape(info, gate_up), _parameter_shape(info, down)
    if len(gu_shape) != 3 or len(down_shape) != 3:
        raise PatternRefused("the expert parameters are not 3-D [experts, out, in]")
    double = m.BinaryOperation(left=m.Integer("2"), operator=m.Multiply())
    if not m.matches(gu_shape[1], double):
        raise PatternRefused(f"gate/up rows `{code(gu_shape[1])}` are not `2 * <size>`")
    return ExpertsSpec(
        class_name=info.name,
        gate_up=gate_up,
        down=down,
        act_attr=act,
        act_name=lookup.slice[0].slice.value,
        num_experts=gu_shape[0],
        intermediate=gu_shape[1].right,
        hidden=gu_shape[2],
    )


def match(info: ClassInfo, classes: dict[str, ClassInfo]) -> MoESpec | Refusal | None:
    """The block, if `info` builds a top-k router and stacked experts."""
    from .. import glu

    roles: dict[str, tuple[str, object]] = {}
    dense: dict[str, str] = {}
    try:
        for attr in info.attrs:
            cls = classes.get(info.constructed_class(attr) or "")
            if cls is None:
                continue
            if (router := match_router(cls)) is not None:
                roles["router"] = (attr, router)
            elif (experts := match_experts(cls)) is not None:
                roles["experts"] = (attr, experts)
            elif isinstance(glu.match(cls), glu.GLUSpec):
                dense[attr] = cls.name
    except PatternRefused as why:
        return Refusal(NAME, info.name, "router + experts", str(why))
    if not roles:
        return None
    if set(roles) != {"router", "experts"}:
        missing = ({"router", "experts"} - set(roles)).pop()
        return Refusal(
            NAME, info.name, "router + experts", f"no {missing} class matched"
        )
    try:
        return _block(info, classes, roles, dense)
    except PatternRefused as why:
        return Refusal(NAME, info.name, "router + experts", str(why))


def _block(info, classes, roles, dense) -> MoESpec:
    (router_attr, router), (experts_attr, experts) = roles["router"], roles["experts"]
    if experts_attr != "experts" or router.weight != "weight":
        # vLLM's fused MoE loader finds expert tensors under `experts.`; the router's
        # tensor loads into GateLinear's `weight`
        raise PatternRefused(
            f"self.{experts_attr} / {router.class_name}.{router.weight} are not named "
            "`experts` / `weight`, not emitted yet"
        )
    sublayers = [a for a in info.attrs if info.constructed_class(a) in classes]
    others = [a for a in sublayers if a not in (router_attr, experts_attr)]
    shared_attr = None
    if others:
        # a dense GLU added to the routed output: shared experts
        added = m.findall(
            info.forward,
            m.BinaryOperation(operator=m.Add(), right=m.Call(func=_SELF)),
        )
        shared = [
            o.right.func.attr.value for o in added if o.right.func.attr.value in dense
        ]
        if len(others) != 1 or shared != others:
            raise PatternRefused(
                f"the block also builds self.{others[0]}, not a dense MLP added to the output"
            )
        shared_attr = others[0]
    calls = {
        a: m.findall(
            info.forward, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(a)))
        )
        for a in (router_attr, experts_attr)
    }
    if any(len(c) != 1 for c in calls.values()):
        raise PatternRefused(
            "the block does not call its router and its experts once each"
        )
    r_info, e_info = classes[router.class_name], classes[experts.class_name]
    r_args = bind(r_info, info.attrs[router_attr])
    e_args = bind(e_info, info.attrs[experts_attr])

    def in_block(expr):
        return code(resolve(expr, r_info, r_args))

    routing = []
    if router.scoring != "softmax":
        routing.append(("scoring_func", repr(router.scoring)))
    if router.bias is not None:
        routing.append(("e_score_correction_bias", f"self.{router_attr}.{router.bias}"))
    if router.groups is not None:
        routing += [
            ("use_grouped_topk", "True"),
            ("num_expert_group", in_block(router.groups)),
            ("topk_group", in_block(router.topk_group)),
        ]
    elif router.scoring != "softmax":
        # one group of every expert: plain top-k (what the proof runs), and the routing
        # vLLM's CPU fused MoE takes for a non-softmax score
        routing += [
            ("use_grouped_topk", "True"),
            ("num_expert_group", "1"),
            ("topk_group", "1"),
        ]
    if router.scale is not None:
        routing.append(("routed_scaling_factor", in_block(router.scale)))
    return MoESpec(
        class_name=info.name,
        router_attr=router_attr,
        experts_attr=experts_attr,
        router=router,
        experts=experts,
        num_experts=resolve(experts.num_experts, e_info, e_args),
        top_k=resolve(router.top_k, r_info, r_args),
        hidden=resolve(experts.hidden, e_info, e_args),
        intermediate=resolve(experts.intermediate, e_info, e_args),
        renormalize=resolve(router.renormalize, r_info, r_args),
        activation=resolve(experts.act_name, e_info, e_args),
        routing=tuple(routing),
        shared_attr=shared_attr,
        shared_class=dense.get(shared_attr) if shared_attr else None,
    )


def records(spec: MoESpec, scope: str) -> list[FusionRecord]:
    return [
        FusionRecord(
            NAME,
            spec.class_name,
            (spec.router_attr, spec.experts_attr),
            spec.experts_attr,
            VLLM_CLASS,
            scope=scope,
            detail=spec.describe_routing(),
        )
    ]
