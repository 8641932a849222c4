"""`down(act(gate(x)) * up(x))` -> `MergedColumnParallelLinear` + a fused `...AndMul`.

Matched on the MLP class's forward in either operand order of the product; or, for a
checkpoint that packs [gate; up] in one projection (Phi-3), the statements

    y = self.<packed>(x)
    gate, up = y.chunk(2, dim=-1)
    y = up * self.<act>(gate)       # either operand order
    return self.<down>(y)
 The shard
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
    CLASS,
    Claim,
    ClassInfo,
    FusionRecord,
    Pattern,
    PatternRefused,
    Refusal,
    chunk_call,
    code,
    is_linear,
    linear_args,
    self_call,
)
from .emitting import indent, signature, translate_init
from .qkv.match import merged_name

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
    # gate and up are the two halves of one projection in the checkpoint (`gate` and
    # `up` both name it); its weight loader splits it
    packed: bool = False


def match(info: ClassInfo) -> GLUSpec | Refusal | None:
    if info.forward is None:
        return None
    found = m.extractall(info.forward, GLU_CALL)
    if not found:
        try:
            packed = _packed(info)
        except PatternRefused as why:
            return Refusal(NAME, info.name, "packed gate/up projection", str(why))
        if packed is None and _mlp_like(info):
            # an MLP the reader would take for gated: say why it is not fused
            return Refusal(
                NAME,
                info.name,
                "gate/up projections",
                "forward has no `down(act(gate(x)) * up(x))` product",
            )
        return packed
    try:
        return _extract(info, found[0])
    except PatternRefused as why:
        return Refusal(NAME, info.name, "gate/up projections", str(why))


def _mlp_like(info: ClassInfo) -> bool:
    """Two linears or more and an ACT2FN activation: an MLP."""
    linears = [a for a in info.attrs if is_linear(info, a)]
    return len(linears) >= 2 and any(
        m.matches(v, ACT2FN_LOOKUP) for v in info.attrs.values()
    )


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


def _packed(info: ClassInfo) -> GLUSpec | None:
    body = [s for s in info.forward.body.body if isinstance(s, cst.SimpleStatementLine)]
    chunk = chunk_call(2)
    split = [
        s
        for s in body
        if m.matches(
            s,
            m.SimpleStatementLine(
                [m.Assign([m.AssignTarget(m.Tuple([m.Element(), m.Element()]))], chunk)]
            ),
        )
    ]
    if not split:
        return None
    if len(body) != 4 or body[1] is not split[0]:
        raise PatternRefused("forward is not projection, chunk, product, down")
    first, _, product, ret = body
    gate_name, up_name = (
        e.value.value for e in split[0].body[0].targets[0].target.elements
    )
    packed_var = split[0].body[0].value.func.value.value
    got = m.extract(
        first,
        m.SimpleStatementLine(
            [
                m.Assign(
                    [m.AssignTarget(m.Name(packed_var))],
                    self_call(m.SaveMatchedNode(m.Name(), "packed"), m.Name()),
                )
            ]
        ),
    )
    if got is None:
        raise PatternRefused(f"`{packed_var}` is not one projection of the input")
    gated = self_call(m.SaveMatchedNode(m.Name(), "act"), m.Name(gate_name))
    prod = m.extract(
        product,
        m.SimpleStatementLine(
            [
                m.Assign(
                    [m.AssignTarget(m.SaveMatchedNode(m.Name(), "y"))],
                    m.BinaryOperation(
                        left=m.Name(up_name), operator=m.Multiply(), right=gated
                    )
                    | m.BinaryOperation(
                        left=gated, operator=m.Multiply(), right=m.Name(up_name)
                    ),
                )
            ]
        ),
    )
    if prod is None:
        raise PatternRefused(
            f"`{code(product).strip()}` is not the up half times the activated first half"
        )
    down = m.extract(
        ret,
        m.SimpleStatementLine(
            [
                m.Return(
                    self_call(
                        m.SaveMatchedNode(m.Name(), "down"), m.Name(prod["y"].value)
                    )
                )
            ]
        ),
    )
    if down is None:
        raise PatternRefused("forward does not return down(product)")
    packed, act, down = got["packed"].value, prod["act"].value, down["down"].value
    for attr in (packed, down):
        if not is_linear(info, attr):
            raise PatternRefused(f"self.{attr} is not an nn.Linear")
    lookup = info.attrs.get(act)
    if not m.matches(lookup, ACT2FN_LOOKUP):
        raise PatternRefused(f"self.{act} is not an ACT2FN[...] activation")
    in_size, out_size, bias = linear_args(info.attrs[packed])
    # 2 * <intermediate size>: each half is one shard
    if not m.matches(
        out_size, m.BinaryOperation(left=m.Integer("2"), operator=m.Multiply())
    ):
        raise PatternRefused(
            f"packed output size `{code(out_size)}` is not `2 * <size>`"
        )
    half = (in_size, out_size.right, bias)
    return GLUSpec(
        class_name=info.name,
        gate=packed,
        up=packed,
        down=down,
        act_attr=act,
        act_name=lookup.slice[0].slice.value,
        merged=packed,
        gate_args=half,
        up_args=half,
        down_args=linear_args(info.attrs[down]),
        packed=True,
    )


def records(spec: GLUSpec, scope: str) -> list[FusionRecord]:
    # a packed checkpoint tensor stacks nothing: the weight loader splits it
    return [
        FusionRecord(
            NAME,
            spec.class_name,
            (spec.merged,) if spec.packed else (spec.gate, spec.up),
            spec.merged,
            VLLM_CLASS,
            () if spec.packed else (0, 1),
            scope,
            packed="packed in the checkpoint" if spec.packed else "",
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

    from .dataflow import single_call, trace

    graph = trace(module)
    if spec.packed:
        _prove_packed(spec, module, config, graph)
        return
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

    g, u = (getattr(module, n) for n in (spec.gate, spec.up))
    weight = torch.cat([g.weight, u.weight])
    bias = torch.cat([g.bias, u.bias]) if g.bias is not None else None
    _prove_numbers(spec, module, config, weight, bias)


def _prove_packed(spec: GLUSpec, module, config, graph) -> None:
    """Dataflow: the packed projection reads the input and down makes the output, each
    called once; the halves' roles are left to the numbers."""
    from .dataflow import single_call

    packed, down = single_call(graph, spec.gate), single_call(graph, spec.down)
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    output = next(n for n in graph.nodes if n.op == "output")
    if packed.args[0] is not placeholder or output.all_input_nodes != [down]:
        raise PatternRefused(
            "the packed projection does not read the input, or down does not make the output"
        )
    p = getattr(module, spec.gate)
    _prove_numbers(spec, module, config, p.weight, p.bias)


def _prove_numbers(spec: GLUSpec, module, config, weight, bias) -> None:
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.activation import get_act_and_mul_fn

    from .dataflow import require_close

    name = activation_name(spec, module, config)
    try:
        act_and_mul = get_act_and_mul_fn(name)
    except ValueError:
        raise PatternRefused(
            f"vLLM has no fused ...AndMul for activation {name!r}"
        ) from None
    d = getattr(module, spec.down)
    with torch.no_grad():
        x = torch.randn(
            2, 5, weight.shape[1], generator=torch.Generator().manual_seed(0)
        )
        merged = F.linear(x, weight, bias)
        require_close(
            d(act_and_mul.forward_native(merged)),
            module(x),
            f"{spec.class_name} merged gate/up",
        )


# --- the pattern -----------------------------------------------------------------------

WHAT = "gate/up projections"


class GLU(Pattern):
    name = NAME

    def claim(self, model):
        for n in model.sublayer_candidates():
            if model.refused(n):  # a block another pattern looked at (a MoE router)
                continue
            spec = match(model.classes[n])
            inst = model.first(n)
            if spec is None or inst is None:
                continue
            if isinstance(spec, Refusal):
                yield spec
                continue
            try:
                prove(spec, inst, model.config)
            except PatternRefused as why:
                yield Refusal(NAME, n, WHAT, str(why))
                continue
            except Exception as exc:  # a proof that cannot even run is a refusal
                text = str(exc).splitlines()[0] if str(exc) else ""
                yield Refusal(
                    NAME, n, WHAT, f"proof failed to run: {type(exc).__name__}: {text}"
                )
                continue
            yield Claim(
                self,
                n,
                spec,
                CLASS,
                records=[
                    r
                    for scope in model.roles.scopes.get(n, [""])
                    for r in records(spec, scope)
                ],
            )

    def emit_class(self, claim: Claim, info: ClassInfo) -> str:
        return emit(info, claim.spec)


def emit(info: ClassInfo, spec: GLUSpec) -> str:
    """The MLP class: gate and up merged into one column-parallel GEMM, down
    row-parallel, vLLM's fused activation-and-multiply between them."""

    def translate(attr: str, value: cst.BaseExpression) -> list[str] | None:
        if attr == spec.gate:
            in_size, _, bias = spec.gate_args
            sizes = f"[{code(spec.gate_args[1])}, {code(spec.up_args[1])}]"
            return [
                f"# Fused: {spec.gate} + {spec.up} -> {spec.merged} (shard 0 is the activated side)",
                f"self.{spec.merged} = MergedColumnParallelLinear({code(in_size)}, {sizes}, "
                f'bias={code(bias)}, quant_config=quant_config, prefix=f"{{prefix}}.{spec.merged}")',
            ]
        if attr == spec.up:
            return []
        if attr == spec.down:
            in_size, out_size, bias = spec.down_args
            return [
                f"self.{spec.down} = RowParallelLinear({code(in_size)}, {code(out_size)}, "
                f'bias={code(bias)}, quant_config=quant_config, prefix=f"{{prefix}}.{spec.down}")'
            ]
        if attr == spec.act_attr:
            return [f"self.{attr} = get_act_and_mul_fn({code(spec.act_name)})"]
        return None

    body = translate_init(info, translate)
    return f"""
class {info.name}(nn.Module):
    def __init__({signature(info)}) -> None:
{indent(body)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        {spec.merged}, _ = self.{spec.merged}(x)
        x, _ = self.{spec.down}(self.{spec.act_attr}({spec.merged}))
        return x
"""
