"""`down(act(gate(x)) * up(x))` -> `MergedColumnParallelLinear` + a fused `...AndMul`.

Matched on the MLP class's forward in either operand order of the product. The shard
order follows the activation: the projection under `act` is shard 0, because vLLM's
`...AndMul` applies the activation to the first half. The activation is whatever
`ACT2FN[<expr>]` the source reads, resolved at model build time by vLLM's
`get_act_and_mul_fn`, which raises on a name it has no fused kernel for.
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
    self_call,
)
from .qkv import merged_name

NAME = "glu"
VLLM_CLASS = "MergedColumnParallelLinear"

# Any argument is captured here and checked in `_extract`, so a near miss is refused
# with its reason instead of silently not matching.
_X = m.SaveMatchedNode(m.DoNotCare(), "x")
_X2 = m.SaveMatchedNode(m.DoNotCare(), "x2")
_GATED = self_call(
    m.SaveMatchedNode(m.Name(), "act"),
    self_call(m.SaveMatchedNode(m.Name(), "gate"), _X),
)
_UP = self_call(m.SaveMatchedNode(m.Name(), "up"), _X2)
GLU_CALL = self_call(
    m.SaveMatchedNode(m.Name(), "down"),
    m.BinaryOperation(left=_GATED, operator=m.Multiply(), right=_UP)
    | m.BinaryOperation(left=_UP, operator=m.Multiply(), right=_GATED),
)
# self.act_fn = ACT2FN[config.hidden_act]
ACT2FN_LOOKUP = m.Subscript(value=m.Name("ACT2FN"))


@dataclass(frozen=True)
class GLUSpec:
    class_name: str
    gate: str
    up: str
    down: str
    act_attr: str
    act_name: cst.BaseExpression  # expression the source looks the activation up by
    merged: str
    gate_args: tuple[cst.BaseExpression, cst.BaseExpression, cst.BaseExpression]
    up_args: tuple[cst.BaseExpression, cst.BaseExpression, cst.BaseExpression]
    down_args: tuple[cst.BaseExpression, cst.BaseExpression, cst.BaseExpression]


def match(info: ClassInfo) -> GLUSpec | Refusal | None:
    if info.forward is None:
        return None
    found = m.extractall(info.forward, GLU_CALL)
    if not found:
        return None
    try:
        return _extract(info, found[0])
    except PatternRefused as why:
        return Refusal(NAME, info.name, "gate/up projections", str(why))


def _extract(info: ClassInfo, cap: dict) -> GLUSpec:
    gate, up, down, act = (cap[k].value for k in ("gate", "up", "down", "act"))
    x, x2 = cap["x"], cap["x2"]
    if not (
        isinstance(x, cst.Name) and isinstance(x2, cst.Name) and x.value == x2.value
    ):
        raise PatternRefused(
            f"gate and up read different tensors (`{code(x)}`, `{code(x2)}`)"
        )
    for attr in (gate, up, down):
        if not is_linear(info, attr):
            raise PatternRefused(f"self.{attr} is not an nn.Linear")
    lookup = info.attrs.get(act)
    if not m.matches(lookup, ACT2FN_LOOKUP):
        raise PatternRefused(f"self.{act} is not an ACT2FN[...] activation")
    gate_args, up_args = linear_args(info.attrs[gate]), linear_args(info.attrs[up])
    if code(gate_args[0]) != code(up_args[0]) or code(gate_args[2]) != code(up_args[2]):
        raise PatternRefused("gate and up differ in input size or bias")
    return GLUSpec(
        class_name=info.name,
        gate=gate,
        up=up,
        down=down,
        act_attr=act,
        act_name=lookup.slice[0].slice.value,
        merged=merged_name((gate, up), sep="_"),
        gate_args=gate_args,
        up_args=up_args,
        down_args=linear_args(info.attrs[down]),
    )


def records(spec: GLUSpec, scope: str) -> list[FusionRecord]:
    return [
        FusionRecord(
            NAME,
            spec.class_name,
            (spec.gate, spec.up),
            spec.merged,
            VLLM_CLASS,
            (0, 1),
            scope,
        )
    ]


# --- proof -------------------------------------------------------------------------
# Dataflow: gate and up read one node; the activation reads the gate output only; the
# product of the two, and nothing else, feeds down. Numbers: the module against
# down(act_and_mul(x @ [W_gate; W_up]^T)) with vLLM's fused activation.


def activation_name(spec: GLUSpec, module, config) -> str:
    try:
        return str(
            eval(code(spec.act_name), {"config": config, "self": module})
        )  # noqa: S307
    except Exception as exc:
        raise PatternRefused(
            f"the activation key `{code(spec.act_name)}` cannot be evaluated: {exc}"
        ) from None


def prove(spec: GLUSpec, module, config) -> None:
    import torch
    import torch.nn.functional as F

    from .dataflow import require_close, single_call, trace

    graph = trace(module)
    gate, up, down, act = (
        single_call(graph, n) for n in (spec.gate, spec.up, spec.down, spec.act_attr)
    )
    if gate.args[0] is not up.args[0]:
        raise PatternRefused("gate and up consume different graph nodes")
    if act.args[0] is not gate or len(gate.users) != 1:
        raise PatternRefused("the activation is not applied to the gate output alone")
    product = down.args[0]
    if not (
        product.op == "call_function"
        and getattr(product.target, "__name__", "") == "mul"
    ):
        raise PatternRefused("what feeds down is not a product")
    if set(product.args) != {act, up} or len(product.users) != 1 or len(up.users) != 1:
        raise PatternRefused(
            "the product of act(gate) and up is not all that feeds down"
        )

    from vllm.model_executor.layers.activation import get_act_and_mul_fn

    name = activation_name(spec, module, config)
    try:
        act_and_mul = get_act_and_mul_fn(name)
    except ValueError:
        raise PatternRefused(
            f"vLLM has no fused ...AndMul for activation {name!r}"
        ) from None
    g, u, d = (getattr(module, n) for n in (spec.gate, spec.up, spec.down))
    with torch.no_grad():
        x = torch.randn(2, 5, g.in_features, generator=torch.Generator().manual_seed(0))
        weight = torch.cat([g.weight, u.weight])
        bias = torch.cat([g.bias, u.bias]) if g.bias is not None else None
        merged = F.linear(x, weight, bias)
        require_close(
            d(act_and_mul.forward_native(merged)),
            module(x),
            f"{spec.class_name} merged gate/up",
        )
