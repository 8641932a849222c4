"""RMSNorm classes -> vLLM `RMSNorm` (or `GemmaRMSNorm` for the `1 + w` form).

Matched on the norm class's methods (the forward and helpers it calls, such as Gemma's
`_norm`; the proof runs the real forward): mean of squares over the last dim, eps added inside
`rsqrt`, a multiply by `self.weight` (or `1 + self.weight`) after casting back. The eps
and weight-size arguments are read from the class's own `__init__` signature, so every
construction site of the class can be translated argument by argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from .base import (
    CONSTRUCTION,
    Claim,
    ClassInfo,
    FusionRecord,
    Pattern,
    PatternRefused,
    Refusal,
    code,
    dotted_name,
    self_attr,
)

NAME = "rms_norm"

# variance = x.pow(2).mean(-1, keepdim=True)
MEAN_OF_SQUARES = m.Call(
    func=m.Attribute(
        value=m.Call(
            func=m.Attribute(attr=m.Name("pow")), args=[m.Arg(m.Integer("2"))]
        ),
        attr=m.Name("mean"),
    ),
    args=[
        m.Arg(m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1"))),
        m.Arg(keyword=m.Name("keepdim"), value=m.Name("True")),
    ],
)
# torch.rsqrt(variance + self.<eps>): eps inside the root
RSQRT_EPS = m.Call(
    func=m.Attribute(value=m.Name("torch"), attr=m.Name("rsqrt")),
    args=[
        m.Arg(
            m.BinaryOperation(
                operator=m.Add(), right=m.SaveMatchedNode(self_attr(), "eps")
            )
        )
    ],
)
UNIT_OFFSET_WEIGHT = m.BinaryOperation(
    left=m.OneOf(m.Integer("1"), m.Float("1.0")),
    operator=m.Add(),
    right=m.OneOf(
        self_attr("weight"), m.Call(func=m.Attribute(value=self_attr("weight")))
    ),
)
# return self.weight * x.to(input_dtype)   |   return x.to(dtype) * self.weight
WEIGHT_AFTER_CAST = m.BinaryOperation(
    operator=m.Multiply(),
    left=m.OneOf(self_attr("weight"), m.Call(func=m.Attribute(attr=m.Name("to")))),
    right=m.OneOf(self_attr("weight"), m.Call(func=m.Attribute(attr=m.Name("to")))),
)


@dataclass(frozen=True)
class NormSpec:
    class_name: str
    vllm_class: str  # "RMSNorm" | "GemmaRMSNorm"
    eps_attr: str  # the attribute the forward reads eps from
    size_param: str
    eps_param: str
    eps_default: cst.BaseExpression | None
    params: tuple[str, ...]  # __init__ parameters after self, in order

    def bind(
        self, call: cst.Call
    ) -> tuple[cst.BaseExpression, cst.BaseExpression | None]:
        """(hidden size, eps) of one construction `NormClass(...)` of this class."""
        bound: dict[str, cst.BaseExpression] = {}
        for i, arg in enumerate(call.args):
            if arg.keyword is not None:
                bound[arg.keyword.value] = arg.value
            elif arg.star:
                raise PatternRefused(f"{self.class_name}(*args) cannot be bound")
            else:
                bound[self.params[i]] = arg.value
        if self.size_param not in bound:
            raise PatternRefused(f"{self.class_name}(...) without its size")
        return bound[self.size_param], bound.get(self.eps_param, self.eps_default)


def _found(node: cst.CSTNode, matcher) -> list:
    return m.findall(node, matcher)


def match(info: ClassInfo) -> NormSpec | Refusal | None:
    """A NormSpec when the class computes RMSNorm, a Refusal on a near miss, else None."""
    if info.forward is None or info.init is None:
        return None
    if not _found(info.node, MEAN_OF_SQUARES):
        return None  # not a norm at all: nothing to report
    try:
        return _extract(info)
    except PatternRefused as why:
        return Refusal(NAME, info.name, info.name, str(why))


def _extract(info: ClassInfo) -> NormSpec:
    rsqrt = m.extractall(info.node, RSQRT_EPS)
    if not rsqrt:
        raise PatternRefused(
            "eps is not added inside the root (expected torch.rsqrt(variance + eps))"
        )
    eps_attr = rsqrt[0]["eps"].attr.value
    unit_offset = bool(_found(info.node, UNIT_OFFSET_WEIGHT))
    if not unit_offset and not _found(info.node, WEIGHT_AFTER_CAST):
        raise PatternRefused(
            "the weight is not applied as a multiply after the cast back"
        )

    params = [p for p in info.init.params.params if p.name.value != "self"]
    names = tuple(p.name.value for p in params)
    eps_value = info.attrs.get(eps_attr)
    if not isinstance(eps_value, cst.Name) or eps_value.value not in names:
        raise PatternRefused(f"self.{eps_attr} is not set from an __init__ argument")
    weight = info.attrs.get("weight")
    size = (
        m.findall(
            weight,
            m.Call(
                func=m.Attribute(
                    value=m.Name("torch"), attr=m.Name("ones") | m.Name("zeros")
                )
            ),
        )
        if weight
        else []
    )
    if not size or not isinstance(size[0].args[0].value, cst.Name):
        raise PatternRefused(
            "self.weight is not a parameter sized by an __init__ argument"
        )
    eps_param = eps_value.value
    default = next((p.default for p in params if p.name.value == eps_param), None)
    return NormSpec(
        class_name=info.name,
        vllm_class="GemmaRMSNorm" if unit_offset else "RMSNorm",
        eps_attr=eps_attr,
        size_param=size[0].args[0].value.value,
        eps_param=eps_param,
        eps_default=default,
        params=names,
    )


def record(spec: NormSpec, owner: str, attr: str) -> FusionRecord:
    return FusionRecord(NAME, owner, (attr,), attr, spec.vllm_class)


def is_norm_call(
    value: cst.BaseExpression, specs: dict[str, NormSpec]
) -> NormSpec | None:
    if isinstance(value, cst.Call):
        return specs.get(dotted_name(value.func) or "")
    return None


# --- proof -------------------------------------------------------------------------
# Dataflow: mean of squares over the last dim feeds rsqrt(. + eps), whose product with
# the input is multiplied by the weight. Numbers: the module against vLLM's norm with
# the same weight, with an eps large enough that its placement matters, in fp32 and (to
# catch where the casts happen) in bf16, plain and with the fused residual add.
PROOF_EPS = 0.37


def _vllm_norm(spec: NormSpec, size: int, eps: float):
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    return (GemmaRMSNorm if spec.vllm_class == "GemmaRMSNorm" else RMSNorm)(
        size, eps=eps
    )


def prove(spec: NormSpec, module) -> None:
    import copy

    import torch

    from .dataflow import require_close, trace

    graph = trace(module)
    ops = [
        str(n.target) if n.op != "call_function" else getattr(n.target, "__name__", "")
        for n in graph.nodes
    ]
    for needed in ("pow", "mean", "rsqrt"):
        if needed not in ops:
            raise PatternRefused(f"no `{needed}` in the traced forward")
    eps_attr = spec.eps_attr
    weight = module.weight
    size = weight.shape[-1]
    saved = getattr(module, eps_attr)
    setattr(module, eps_attr, PROOF_EPS)
    try:
        with torch.no_grad():
            ours = _vllm_norm(spec, size, PROOF_EPS)
            ours.weight.copy_(weight.detach())
            gen = torch.Generator().manual_seed(0)
            x = 0.3 * torch.randn(3, 5, size, generator=gen)
            r = 0.3 * torch.randn(3, 5, size, generator=gen)
            require_close(ours.forward_native(x), module(x), "RMSNorm")
            out, residual = ours.forward_native(x.clone(), r.clone())
            require_close(residual, x + r, "fused residual add")
            require_close(out, module(x + r), "fused residual add + norm")
            # bf16: the same casts in the same places give the same bits
            module_bf16 = copy.deepcopy(module).to(torch.bfloat16)
            ours.to(torch.bfloat16)
            xb = x.to(torch.bfloat16)
            require_close(
                ours.forward_native(xb),
                module_bf16(xb),
                "RMSNorm in bf16 (cast order)",
                tol=1e-2,
            )
    finally:
        setattr(module, eps_attr, saved)


# --- the pattern -----------------------------------------------------------------------


class RMSNormPattern(Pattern):
    """A norm class vLLM's `RMSNorm` computes: not emitted; each construction of it
    becomes vLLM's norm with the same size and eps."""

    name = NAME

    def claim(self, model):
        for n in model.roles.wanted:
            result = match(model.classes[n])
            if result is None:
                continue
            if isinstance(result, Refusal):
                yield result
                continue
            inst = model.first(n)
            if inst is None:
                continue
            try:
                prove(result, inst)
            except PatternRefused as why:
                yield Refusal(NAME, n, n, str(why))
                continue
            yield Claim(
                self,
                n,
                result,
                CONSTRUCTION,
                records=[
                    record(result, owner, attr)
                    for owner in model.roles.wanted
                    for attr in model.classes[owner].attrs
                    if n in model.classes[owner].constructed_classes(attr)
                ],
            )

    def construction(self, claim: Claim, call: cst.Call) -> str:
        size, eps = claim.spec.bind(call)
        eps_arg = f", eps={code(eps)}" if eps is not None else ""
        return f"{claim.spec.vllm_class}({code(size)}{eps_arg})"
