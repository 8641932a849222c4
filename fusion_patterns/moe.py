"""A sparse MoE block (a top-k router and stacked experts) -> vLLM's fused MoE layer.

Matched on three classes the block builds from the source:

    router:   logits = <F>.linear(x, self.<weight>)           # weight [E, H]
              probs = softmax(logits, dim=-1)
              top, idx = torch.topk(probs, self.<top_k>, dim=-1)
              [if self.<flag>:] top /= top.sum(dim=-1, keepdim=True)
    experts:  self.<gate_up> = nn.Parameter(torch.empty(E, 2 * I, H))
              self.<down> = nn.Parameter(torch.empty(E, H, I))
              gate, up = <F>.linear(x, self.<gate_up>[e]).chunk(2, dim=-1)
              y = <F>.linear(self.<act>(gate) * up, self.<down>[e]) * weight
    block:    _, w, idx = self.<router>(x);  self.<experts>(x, idx, w)

vLLM's `FusedMoE` computes exactly that: softmax over the router logits, top-k,
optionally renormalised, then sum_k w_k * down_e(act(gate_e x) * up_e x). A router that
scores another way (sigmoid, a correction bias, grouped top-k, a scaling factor) fails
the proof and is refused; it is never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from .base import ClassInfo, FusionRecord, PatternRefused, Refusal, chunk_call, code
from .glu import ACT2FN_LOOKUP

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
_TOPK = m.Call(
    func=m.Attribute(value=m.Name("torch"), attr=m.Name("topk")),
    args=[m.Arg(), m.Arg(m.Attribute(value=m.Name("self"))), m.ZeroOrMore()],
)
# <t>.sum(dim=-1, keepdim=True)
_ROW_SUM = m.Call(
    func=m.Attribute(value=m.Name(), attr=m.Name("sum")),
    args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("keepdim")), m.ZeroOrMore()],
)
_RENORMALIZE = m.AugAssign(operator=m.DivideAssign(), value=_ROW_SUM) | m.Assign(
    value=m.BinaryOperation(operator=m.Divide(), right=_ROW_SUM)
)
# the router scorings vLLM's FusedMoE has but this pattern does not emit yet
_OTHER_SCORING = ("sigmoid", "e_score_correction_bias", "topk_group", "n_group")


@dataclass(frozen=True)
class RouterSpec:
    class_name: str
    weight: str
    top_k: cst.BaseExpression
    # `True` when renormalised unconditionally, `False` when not, else the flag's value
    renormalize: cst.BaseExpression
    # the router attribute the renormalisation is guarded by (its flag), if any
    flag: str | None


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

    def describe_routing(self) -> str:
        renorm = code(self.renormalize)
        how = {"True": ", renormalised", "False": ""}.get(
            renorm, f", renormalised when `{renorm}`"
        )
        return f"softmax top-`{code(self.top_k)}` of `{code(self.num_experts)}` experts{how}"


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
            return resolve(value, self.info, self.args)
        return updated.with_changes(attr=original.attr)  # `x.<name>` is no parameter

    def leave_Arg(self, original, updated):
        return updated.with_changes(keyword=original.keyword)

    def leave_Name(self, original, updated):
        return self.args.get(original.value, updated)


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


def match_router(info: ClassInfo) -> RouterSpec | None:
    if info.forward is None or not m.findall(info.forward, _TOPK):
        return None
    linears = m.findall(info.forward, _LINEAR)
    if len(linears) != 1 or not m.matches(
        linears[0].args[1].value if len(linears[0].args) > 1 else None,
        m.Attribute(value=m.Name("self")),
    ):
        raise PatternRefused("the router logits are not one linear of self.<weight>")
    weight = linears[0].args[1].value.attr.value
    if len(_parameter_shape(info, weight)) != 2:
        raise PatternRefused(f"self.{weight} is not a 2-D [experts, hidden] parameter")
    for name in _OTHER_SCORING:
        if m.findall(info.forward, m.Name(name) | m.Attribute(attr=m.Name(name))):
            raise PatternRefused(f"routing uses `{name}`, not emitted yet")
    if not m.findall(info.forward, _SOFTMAX):
        raise PatternRefused("the router does not score with a softmax")
    topk = m.findall(info.forward, _TOPK)
    if len(topk) != 1:
        raise PatternRefused("the router calls torch.topk more than once")
    top_k = topk[0].args[1].value.attr.value
    renormalize: cst.BaseExpression = cst.Name("False")
    flag = None
    for stmt in info.forward.body.body:
        if m.findall(stmt, _RENORMALIZE):
            if m.matches(stmt, m.If(test=m.Attribute(value=m.Name("self")))):
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
        top_k=cst.parse_expression(f"self.{top_k}"),
        renormalize=renormalize,
        flag=flag,
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
    roles: dict[str, tuple[str, object]] = {}
    try:
        for attr in info.attrs:
            cls = classes.get(info.constructed_class(attr) or "")
            if cls is None:
                continue
            if (router := match_router(cls)) is not None:
                roles["router"] = (attr, router)
            elif (experts := match_experts(cls)) is not None:
                roles["experts"] = (attr, experts)
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
        return _block(info, classes, roles)
    except PatternRefused as why:
        return Refusal(NAME, info.name, "router + experts", str(why))


def _block(info, classes, roles) -> MoESpec:
    (router_attr, router), (experts_attr, experts) = roles["router"], roles["experts"]
    if experts_attr != "experts" or router.weight != "weight":
        # vLLM's fused MoE loader finds expert tensors under `experts.`; the router's
        # tensor loads into GateLinear's `weight`
        raise PatternRefused(
            f"self.{experts_attr} / {router.class_name}.{router.weight} are not named "
            "`experts` / `weight`, not emitted yet"
        )
    sublayers = [a for a in info.attrs if info.constructed_class(a) in classes]
    if len(sublayers) != 2:
        others = [a for a in sublayers if a not in (router_attr, experts_attr)]
        raise PatternRefused(
            f"the block also builds self.{others[0]} (shared experts are not emitted yet)"
        )
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


# --- proof ---------------------------------------------------------------------------
# The block's output against vLLM's fused-MoE computation on the module's own weights:
# softmax(x W_r^T) -> top-k -> (renormalise) -> sum_k w_k down_e(act(gate_e x) * up_e x).
# A renormalisation flag is proven both ways (the module is run with it flipped).


def _evaluate(expr: cst.BaseExpression, config, what: str):
    try:
        return eval(
            code(expr), {"config": config, "True": True, "False": False}
        )  # noqa: S307
    except Exception as exc:
        raise PatternRefused(
            f"{what} `{code(expr)}` cannot be evaluated: {exc}"
        ) from None


def fused_reference(x, router_weight, gate_up, down, top_k, renormalize, act_and_mul):
    """vLLM's FusedMoE, written out: one token at a time, one chosen expert at a time."""
    import torch

    probs = torch.softmax(x.float() @ router_weight.float().T, dim=-1)
    weights, chosen = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], chosen[t]):
            h = act_and_mul(x[t : t + 1] @ gate_up[e].T)
            out[t] += w.to(x.dtype) * (h @ down[e].T)[0]
    return out


def prove(spec: MoESpec, module, config) -> None:
    import torch

    from vllm.model_executor.layers.activation import get_act_and_mul_fn
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from .dataflow import require_close

    act = str(_evaluate(spec.activation, config, "the activation key"))
    try:
        MoEActivation.from_str(act)
        act_and_mul = get_act_and_mul_fn(act).forward_native
    except ValueError:
        raise PatternRefused(f"vLLM's fused MoE has no activation {act!r}") from None
    router = getattr(module, spec.router_attr)
    experts = getattr(module, spec.experts_attr)
    top_k = int(_evaluate(spec.top_k, config, "top-k"))
    renormalize = bool(_evaluate(spec.renormalize, config, "the renormalisation"))
    hidden = getattr(router, spec.router.weight).shape[1]
    x = torch.randn(2, 5, hidden, generator=torch.Generator().manual_seed(0))
    cases = [renormalize]
    if spec.router.flag is not None:
        cases.append(not renormalize)
    with torch.no_grad():
        for renorm in cases:
            if spec.router.flag is not None:
                setattr(router, spec.router.flag, renorm)
            try:
                got = module(x)
            finally:
                if spec.router.flag is not None:
                    setattr(router, spec.router.flag, renormalize)
            want = fused_reference(
                x.reshape(-1, hidden),
                getattr(router, spec.router.weight),
                getattr(experts, spec.experts.gate_up),
                getattr(experts, spec.experts.down),
                top_k,
                renorm,
                act_and_mul,
            )
            require_close(
                want,
                got.reshape(-1, hidden),
                f"{spec.class_name} as FusedMoE (renormalize={renorm})",
            )
