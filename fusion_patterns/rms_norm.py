"""RMSNorm classes -> vLLM `RMSNorm` (or `GemmaRMSNorm` for the `1 + w` form).

Matched on the norm class's methods (the forward and helpers it calls, such as Gemma's
`_norm`): a mean of squares over the last dim and an `self.<eps>` added to it under an
inverse root (`torch.rsqrt(v + eps)`, `torch.pow(v + eps, -0.5)`). The eps, weight-size
and weight-switch arguments are read from the class's own `__init__` signature, so every
construction site of the class can be translated argument by argument.

Which of vLLM's forms the class computes is the proof's finding, not the spelling's:
the weight multiplied after the cast back (Llama: `RMSNorm`), in fp32 before it (OLMo 2,
GPT-OSS: `RMSNorm(..., dtype=torch.float32)`, whose kernel then multiplies in the
weight's dtype), `1 + w` (Gemma: `GemmaRMSNorm`), or no weight at all (NanoChat:
`RMSNorm(..., has_weight=False)`). Each must give the module's numbers in fp32 and the
module's bits in bf16, where the cast order shows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    refused_by,
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
_PLUS_EPS = m.BinaryOperation(
    operator=m.Add(), right=m.SaveMatchedNode(self_attr(), "eps")
)
_MINUS_HALF = m.UnaryOperation(operator=m.Minus(), expression=m.Float("0.5"))
# eps under an inverse root: torch.rsqrt(v + self.eps) | torch.pow(v + self.eps, -0.5)
# | (v + self.eps) ** -0.5 | mean_of_squares + self.eps (named, then rooted)
EPS_IN_ROOT = m.OneOf(
    m.Call(
        func=m.Attribute(value=m.Name("torch"), attr=m.Name("rsqrt")),
        args=[m.Arg(_PLUS_EPS)],
    ),
    m.Call(
        func=m.Attribute(value=m.Name("torch"), attr=m.Name("pow")),
        args=[m.Arg(_PLUS_EPS), m.Arg(_MINUS_HALF)],
    ),
    m.BinaryOperation(left=_PLUS_EPS, operator=m.Power(), right=_MINUS_HALF),
    m.BinaryOperation(
        left=MEAN_OF_SQUARES,
        operator=m.Add(),
        right=m.SaveMatchedNode(self_attr(), "eps"),
    ),
)
INVERSE_ROOT = m.OneOf(
    m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("rsqrt"))),
    m.Call(
        func=m.Attribute(value=m.Name("torch"), attr=m.Name("pow")),
        args=[m.Arg(), m.Arg(_MINUS_HALF)],
    ),
    m.BinaryOperation(operator=m.Power(), right=_MINUS_HALF),
)

# the forms vLLM's norms compute, and how the generated file builds each
AFTER_CAST = "weight after the cast back"
FP32_WEIGHT = "weight in fp32, before the cast back"
UNIT_OFFSET = "1 + weight"
NO_WEIGHT = "no weight"
WEIGHTED_FORMS = (AFTER_CAST, FP32_WEIGHT, UNIT_OFFSET)


@dataclass(frozen=True)
class NormSpec:
    class_name: str
    eps_attr: str  # the attribute the forward reads eps from
    size_param: str | None  # None: the class builds no weight
    eps_param: str
    eps_default: cst.BaseExpression | None
    params: tuple[str, ...]  # __init__ parameters after self, in order
    # the __init__ parameter under which the weight is built (Gemma 4's `with_scale`),
    # and its default
    weight_switch: str | None = None
    weight_switch_default: bool = True
    # what the weighted instances compute (the proof's finding)
    form: str = AFTER_CAST

    @property
    def vllm_class(self) -> str:
        return "GemmaRMSNorm" if self.form == UNIT_OFFSET else "RMSNorm"

    def _bound(self, call: cst.Call) -> dict[str, cst.BaseExpression]:
        bound: dict[str, cst.BaseExpression] = {}
        for i, arg in enumerate(call.args):
            if arg.keyword is not None:
                bound[arg.keyword.value] = arg.value
            elif arg.star or i >= len(self.params):
                raise PatternRefused(f"{self.class_name}(*args) cannot be bound")
            else:
                bound[self.params[i]] = arg.value
        return bound

    def weighted(self, call: cst.Call) -> bool:
        """Whether this construction builds the weight."""
        if self.size_param is None:
            return False
        if self.weight_switch is None:
            return True
        value = self._bound(call).get(self.weight_switch)
        if value is None:
            return self.weight_switch_default
        if m.matches(value, m.Name("True") | m.Name("False")):
            return value.value == "True"
        raise PatternRefused(
            f"{self.class_name}({self.weight_switch}={code(value)}): whether it builds "
            "its weight is not a literal"
        )

    def bind(
        self, call: cst.Call
    ) -> tuple[cst.BaseExpression | None, cst.BaseExpression | None]:
        """(hidden size, eps) of one construction `NormClass(...)` of this class (no
        size for a construction without a weight)."""
        bound = self._bound(call)
        if not self.weighted(call):
            return None, bound.get(self.eps_param, self.eps_default)
        if self.size_param not in bound:
            raise PatternRefused(f"{self.class_name}(...) without its size")
        return bound[self.size_param], bound.get(self.eps_param, self.eps_default)

    def form_of(self, call: cst.Call) -> str:
        return self.form if self.weighted(call) else NO_WEIGHT

    def construction(self, call: cst.Call) -> str:
        """The vLLM norm one construction of the class becomes."""
        size, eps = self.bind(call)
        eps_arg = f", eps={code(eps)}" if eps is not None else ""
        form = self.form_of(call)
        if form == NO_WEIGHT:  # the size only sizes a weight (vLLM's backend passes 0)
            return f"RMSNorm(0{eps_arg}, has_weight=False)"
        dtype = ", dtype=torch.float32" if form == FP32_WEIGHT else ""
        return f"{self.vllm_class}({code(size)}{eps_arg}{dtype})"


def _found(node: cst.CSTNode, matcher) -> list:
    return m.findall(node, matcher)


def match(info: ClassInfo) -> NormSpec | Refusal | None:
    """A NormSpec when the class looks like RMSNorm (the proof says which form), a
    Refusal on a near miss, else None."""
    if info.forward is None or info.init is None:
        return None
    if not _found(info.node, MEAN_OF_SQUARES):
        return None  # not a norm at all: nothing to report
    try:
        return _extract(info)
    except PatternRefused as why:
        return Refusal(NAME, info.name, info.name, str(why))


def _extract(info: ClassInfo) -> NormSpec:
    eps = m.extractall(info.node, EPS_IN_ROOT)
    if not eps or not _found(info.node, INVERSE_ROOT):
        raise PatternRefused(
            "eps is not added inside the root (expected torch.rsqrt(variance + eps))"
        )
    eps_attr = eps[0]["eps"].attr.value
    params = [p for p in info.init.params.params if p.name.value != "self"]
    names = tuple(p.name.value for p in params)
    eps_value = info.attrs.get(eps_attr)
    if not isinstance(eps_value, cst.Name) or eps_value.value not in names:
        raise PatternRefused(f"self.{eps_attr} is not set from an __init__ argument")
    eps_param = eps_value.value
    default = next((p.default for p in params if p.name.value == eps_param), None)
    size_param, switch, switch_default = _weight(info, names, params)
    return NormSpec(
        class_name=info.name,
        eps_attr=eps_attr,
        size_param=size_param,
        eps_param=eps_param,
        eps_default=default,
        params=names,
        weight_switch=switch,
        weight_switch_default=switch_default,
    )


def _weight(info: ClassInfo, names, params) -> tuple[str | None, str | None, bool]:
    """(the size argument of `self.weight`, the argument it is built under, that
    argument's default); no size for a class that builds no weight."""
    weight = info.attrs.get("weight")
    if weight is None:
        if "weight" in _self_reads(info):
            raise PatternRefused("self.weight is read but not built in __init__")
        return None, None, True
    size = m.findall(
        weight,
        m.Call(
            func=m.Attribute(
                value=m.Name("torch"), attr=m.Name("ones") | m.Name("zeros")
            )
        ),
    )
    if not size or not isinstance(size[0].args[0].value, cst.Name):
        raise PatternRefused(
            "self.weight is not a parameter sized by an __init__ argument"
        )
    size_param = size[0].args[0].value.value
    if size_param not in names:
        raise PatternRefused(
            "self.weight is not a parameter sized by an __init__ argument"
        )
    switch = _weight_switch(info, names)
    if switch is None:
        return size_param, None, True
    default = next((p.default for p in params if p.name.value == switch), None)
    if not m.matches(default, m.Name("True") | m.Name("False")):
        raise PatternRefused(f"the weight switch `{switch}` has no literal default")
    return size_param, switch, default.value == "True"


def _weight_switch(info: ClassInfo, names) -> str | None:
    """The __init__ argument `self.weight` is built under (`if self.with_scale:`)."""
    for branch in m.findall(info.init, m.If()):
        builds = _found(
            branch.body,
            m.Assign(targets=[m.AssignTarget(self_attr("weight"))]),
        )
        if not builds:
            continue
        test = branch.test
        if m.matches(test, self_attr()):
            test = info.attrs.get(test.attr.value)
        if isinstance(test, cst.Name) and test.value in names and branch.orelse is None:
            return test.value
        raise PatternRefused(
            f"self.weight is built under `{code(branch.test)}`, not one argument"
        )
    return None


def _self_reads(info: ClassInfo) -> set[str]:
    return {a.attr.value for a in _found(info.node, self_attr())}


def record(spec: NormSpec, owner: str, attr: str, call: cst.Call) -> FusionRecord:
    form = spec.form_of(call)
    detail = "" if form in (AFTER_CAST, UNIT_OFFSET) else form
    return FusionRecord(NAME, owner, (attr,), attr, spec.vllm_class, detail=detail)


def is_norm_call(
    value: cst.BaseExpression, specs: dict[str, NormSpec]
) -> NormSpec | None:
    if isinstance(value, cst.Call):
        return specs.get(dotted_name(value.func) or "")
    return None


# --- proof -------------------------------------------------------------------------
# Dataflow: mean of squares over the last dim feeds an inverse root of (. + eps), whose
# product with the input may be multiplied by the weight. Numbers: the module against
# each of vLLM's norm forms with the module's weight (randomised), with an eps large
# enough that its placement matters: in fp32, plain and with the fused residual add,
# and in bf16, bit for bit, where the place of the cast shows.
PROOF_EPS = 0.37


def _vllm_norm(spec: NormSpec, size: int, eps: float, form: str | None = None):
    """The vLLM norm the generated file builds for `form` (the spec's by default)."""
    import torch

    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    form = form or spec.form
    if form == UNIT_OFFSET:
        return GemmaRMSNorm(size, eps=eps)
    if form == NO_WEIGHT:
        return RMSNorm(0, eps=eps, has_weight=False)
    return RMSNorm(size, eps=eps, dtype=torch.float32 if form == FP32_WEIGHT else None)


def vllm_twin(spec: NormSpec, module, form: str | None = None):
    """vLLM's norm holding `module`'s eps and weight (its forward is `forward_native`)."""
    weight = getattr(module, "weight", None)
    form = form or (spec.form if weight is not None else NO_WEIGHT)
    size = weight.shape[-1] if weight is not None else 0
    ours = _vllm_norm(spec, size, getattr(module, spec.eps_attr), form)
    if weight is not None:
        ours.weight.data.copy_(weight.detach())
    return ours


def _check_form(spec: NormSpec, module, form: str) -> None:
    """Raises PatternRefused unless vLLM's `form` computes `module`."""
    import copy

    import torch

    from .dataflow import require_close

    module = copy.deepcopy(module)
    weight = getattr(module, "weight", None)
    gen = torch.Generator().manual_seed(0)
    size = weight.shape[-1] if weight is not None else 16
    with torch.no_grad():
        if weight is not None:
            weight.copy_(1 + 0.3 * torch.randn(weight.shape, generator=gen))
        setattr(module, spec.eps_attr, PROOF_EPS)
        ours = vllm_twin(spec, module, form)
        x = 0.3 * torch.randn(3, 5, size, generator=gen)
        r = 0.3 * torch.randn(3, 5, size, generator=gen)
        require_close(ours.forward_native(x), module(x), "RMSNorm")
        out, residual = ours.forward_native(x.clone(), r.clone())
        require_close(residual, x + r, "fused residual add")
        require_close(out, module(x + r), "fused residual add + norm")
        # bf16, as a bf16 checkpoint loads: the same casts in the same places give the
        # same bits (an fp32 weight holds the bf16 values exactly)
        module_bf16 = module.to(torch.bfloat16)
        if form != FP32_WEIGHT:
            ours.to(torch.bfloat16)
        if weight is not None:
            ours.weight.data.copy_(module_bf16.weight.detach())
        xb = x.to(torch.bfloat16)
        got, want = ours.forward_native(xb), module_bf16(xb)
        if got.dtype != want.dtype or not torch.equal(got, want):
            raise PatternRefused(f"{form}: not the same bits in bf16 (cast order)")


def prove(spec: NormSpec, modules) -> NormSpec:
    """The spec with the form every instance in `modules` computes (one form for the
    weighted instances, vLLM's weightless norm for the others); PatternRefused if none.
    """
    from .dataflow import trace

    found: str | None = None
    for module in modules:
        graph = trace(module)
        ops = {
            (
                str(n.target)
                if n.op != "call_function"
                else getattr(n.target, "__name__", "")
            )
            for n in graph.nodes
        }
        for needed in ("pow", "mean"):
            if needed not in ops:
                raise PatternRefused(f"no `{needed}` in the traced forward")
        weight = getattr(module, "weight", None)
        if weight is None:
            _check_form(spec, module, NO_WEIGHT)
            continue
        if weight.dim() != 1:
            raise PatternRefused(
                f"its weight is {weight.dim()}-D, vLLM's is one vector"
            )
        if found is not None:
            _check_form(spec, module, found)
            continue
        why = {}
        for form in WEIGHTED_FORMS:
            try:
                _check_form(spec, module, form)
            except PatternRefused as exc:
                why[form] = str(exc)
                continue
            found = form
            break
        else:
            # the closest form's reason: one that computes it in fp32 and differs only
            # in bf16's bits, else vLLM's usual one
            closest = next((w for w in why.values() if "bf16" in w), why[AFTER_CAST])
            raise PatternRefused(
                f"none of vLLM's RMSNorm forms computes it ({closest})"
            )
    return replace(spec, form=found or spec.form)


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
            # one instance of each kind the tiny model built (with a weight, without)
            kinds = {}
            for _, inst in model.probe.instances.get(n, []):
                kinds.setdefault(getattr(inst, "weight", None) is None, inst)
            # a class claimed whole builds its norms as its pattern says
            owners = [
                model.classes[o]
                for o in model.roles.wanted
                if not model.claimed_whole(o)
            ]
            if not any(_builds(info, n) for info in owners) and any(
                _builds(model.classes[o], n) for o in model.roles.wanted
            ):
                continue  # built only inside a claimed class (a mixer's norms): not emitted
            try:
                if not kinds:
                    # built only under another tiny config (Cohere2-MoE's RMSNorm or
                    # LayerNorm by `rms_norm_eps`): a norm builds alone
                    kinds[False] = _built_alone(result, getattr(model.pymodule, n))
                spec = prove(result, list(kinds.values()))
                # every construction the copies will rewrite must translate
                for info in owners:
                    for call in m.findall(info.node, m.Call()):
                        if dotted_name(call.func) == n:
                            spec.construction(call)
                records = [
                    record(spec, info.name, attr, call)
                    for info in owners
                    for attr in info.attrs
                    for call in info.constructions(attr)
                    if dotted_name(call.func) == n
                ]
            except Exception as exc:  # a proof that fails or cannot run: refused
                yield refused_by(exc, NAME, n, n)
                continue
            yield Claim(self, n, spec, CONSTRUCTION, records=_unique(records))

    def construction(self, claim: Claim, call: cst.Call, path: str | None) -> str:
        return claim.spec.construction(call)


def _builds(info: ClassInfo, cls: str) -> bool:
    return any(dotted_name(c.func) == cls for c in m.findall(info.node, m.Call()))


def _built_alone(spec: NormSpec, cls):
    """An instance of the norm class, sized 64, its other arguments their defaults."""
    try:
        return cls(**({spec.size_param: 64} if spec.size_param else {}))
    except Exception as exc:
        raise PatternRefused(
            f"the tiny model never builds it, and it does not build alone "
            f"({type(exc).__name__})"
        ) from None


def _unique(records: list[FusionRecord]) -> list[FusionRecord]:
    return list(dict.fromkeys(records))
