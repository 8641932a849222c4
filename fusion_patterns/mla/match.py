"""Multi-head latent attention (DeepSeek V2/V3) -> vLLM's MLA layer, with the q and kv
down-projections merged into one GEMM (`fused_qkv_a_proj`).

Matched on the attention class's dataflow, not its names:

    q = self.<q_b>(self.<q_norm>(self.<q_a>(x)))      # or self.<q_proj>(x)
    c = self.<kv_a>(x)
    latent, k_rot = torch.split(c, [self.<kv_lora_rank>, self.<rope_dim>], dim=-1)
    latent = self.<kv_norm>(latent)
    ... self.<kv_b>(latent) ...                        # per-head k_nope and v
    return self.<o>(...)

The rope style comes from the functions the source calls (an `...interleave` function
rotates pairs, GPT-J style); the softmax scale is the source's own `self.scaling`. The
proof runs the source module against MLA written out on its own weights, so a role,
size, rope style or scale read wrong is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from ..base import LINEARS, ClassInfo, FusionRecord, PatternRefused, Refusal, code
from ..base import linear_args

NAME = "mla"
VLLM_CLASS = "MultiHeadLatentAttentionWrapper"
MERGED = "fused_qkv_a_proj"

_SELF = m.Attribute(value=m.Name("self"))
_SPLIT = m.Call(
    func=m.Attribute(value=m.Name("torch"), attr=m.Name("split")),
    args=[m.Arg(), m.Arg(m.List([m.Element(_SELF), m.Element(_SELF)])), m.ZeroOrMore()],
)


@dataclass(frozen=True)
class MLASpec:
    class_name: str
    q_a: str
    q_norm: str
    q_b: str
    q_proj: str | None  # the direct q projection when there is no q low-rank
    kv_a: str
    kv_norm: str
    kv_b: str
    o_proj: str
    # `self.<attr>` names of the sizes, as the source's __init__ sets them
    kv_lora_rank: str
    rope_dim: str
    neox: cst.BaseExpression  # rope style: rotate halves (True) or pairs (False)
    # (source rope type, the vLLM rope type proven to compute it) beyond the default
    scaled_ropes: tuple[tuple[str, str], ...] = ()
    # `self.<attr>` scalars the source multiplies the query and the normed latent by
    # (LongCat's MLA LoRA scales): folded into the q and kv norms' weights at load
    q_scale: str | None = None
    kv_scale: str | None = None


def _linear(info: ClassInfo, attr: str) -> cst.Call:
    """The `nn.Linear(...)` call an attribute is built from (inside a conditional too)."""
    calls = [
        c
        for c in m.findall(info.attrs.get(attr, cst.Name("None")), m.Call())
        if code(c.func) in LINEARS
    ]
    if len(calls) != 1:
        raise PatternRefused(f"self.{attr} is not built from one nn.Linear")
    return calls[0]


def linear_of(info: ClassInfo, attr: str):
    return linear_args(_linear(info, attr))


def _called(node: cst.CSTNode) -> list[str]:
    return [c.func.attr.value for c in m.findall(node, m.Call(func=_SELF))]


def match(
    info: ClassInfo, norms: set[str], module: cst.Module | None = None
) -> MLASpec | Refusal | None:
    if info.forward is None:
        return None
    splits = [
        s
        for s in m.findall(info.forward, m.Assign(value=_SPLIT))
        if isinstance(s.targets[0].target, cst.Tuple)
    ]
    if not splits:
        return None
    try:
        return _extract(info, norms, module)
    except PatternRefused as why:
        return Refusal(NAME, info.name, "latent attention", str(why))


def _extract(info: ClassInfo, norms: set[str], module: cst.Module | None) -> MLASpec:
    fwd = info.forward
    linears = {a for a in info.attrs if _is_linear(info, a)}
    norm_attrs = {a for a in info.attrs if norm_class(info, a) in norms}
    # the split of the kv down-projection into the latent and the shared rope key
    kv_a = latent = None
    for assign in m.findall(fwd, m.Assign(value=_SPLIT)):
        source = assign.value.args[0].value
        sizes = [e.value.attr.value for e in assign.value.args[1].value.elements]
        for prior in m.findall(fwd, m.Assign(targets=[m.AssignTarget(m.Name())])):
            if (
                isinstance(source, cst.Name)
                and prior.targets[0].target.value == source.value
                and m.matches(prior.value, m.Call(func=_SELF))
                and prior.value.func.attr.value in linears
            ):
                kv_a = prior.value.func.attr.value
                latent = assign.targets[0].target.elements[0].value.value
                kv_lora_rank, rope_dim = sizes
    if kv_a is None:
        raise PatternRefused("no projection split into [latent, rope] dims")
    # `latent = self.<norm>(latent)`, or the normed latent under another name
    # (`k_nope = self.<norm>(kv_nope).view(...)`): the proof checks what follows
    kv_norms = [
        c.func.attr.value
        for c in m.findall(fwd, m.Call(func=_SELF, args=[m.Arg(m.Name(latent))]))
        if c.func.attr.value in norm_attrs
    ]
    if len(kv_norms) != 1:
        raise PatternRefused(
            f"the latent `{latent}` is not normed once by a proven norm"
        )
    # q: the three-call chain b(norm(a(x))), or one projection
    chains = m.findall(
        fwd,
        m.Call(
            func=_SELF,
            args=[m.Arg(m.Call(func=_SELF, args=[m.Arg(m.Call(func=_SELF))]))],
        ),
    )
    if len(chains) != 1:
        raise PatternRefused("no q low-rank chain self.<b>(self.<norm>(self.<a>(x)))")
    q_b = chains[0].func.attr.value
    q_norm = chains[0].args[0].value.func.attr.value
    q_a = chains[0].args[0].value.args[0].value.func.attr.value
    if q_norm not in norm_attrs or not {q_a, q_b} <= linears:
        raise PatternRefused("the q chain is not linear, proven norm, linear")
    called = set(_called(info.node))
    rest = sorted((linears & called) - {q_a, q_b, kv_a})
    q_proj = next((a for a in rest if a in _called(fwd) and _direct_q(fwd, a)), None)
    rest = [a for a in rest if a != q_proj]
    returned = [
        r.value.func.attr.value
        for r in m.findall(fwd, m.Assign(value=m.Call(func=_SELF)))
        if r.value.func.attr.value in rest
    ]
    if len(rest) != 2 or not returned:
        raise PatternRefused(
            f"expected kv up- and out-projections besides q/kv-a, found {rest}"
        )
    o_proj = returned[-1]
    kv_b = next(a for a in rest if a != o_proj)
    rotary_calls = [
        c
        for c in m.findall(fwd, m.Call(func=m.Name()))
        if "rotary" in c.func.value or "rope" in c.func.value
    ]
    if not rotary_calls:
        raise PatternRefused("no rotary embedding call")
    neox = _rope_style(fwd, _functions(module))
    modules = linears | norm_attrs
    # the query flows from its last projection, the latent from its norm
    q_outputs = [q_b, q_proj] if q_proj else [q_b]
    q_scale = _scale(fwd, _calls(*q_outputs), "query", modules)
    kv_scale = _scale(fwd, _calls(kv_norms[0]), "latent", modules)
    return MLASpec(
        class_name=info.name,
        q_a=q_a,
        q_norm=q_norm,
        q_b=q_b,
        q_proj=q_proj,
        kv_a=kv_a,
        kv_norm=kv_norms[0],
        kv_b=kv_b,
        o_proj=o_proj,
        kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim,
        neox=neox,
        q_scale=q_scale,
        kv_scale=kv_scale,
    )


def _calls(*attrs: str) -> m.BaseMatcherNode:
    """Matcher for a call of any of `self.<attr>`."""
    return m.Call(
        func=m.Attribute(value=m.Name("self"), attr=m.OneOf(*map(m.Name, attrs)))
    )


def _scale(
    fwd: cst.FunctionDef, origin: m.BaseMatcherNode, what: str, modules: set[str]
) -> str | None:
    """The `self.<attr>` scalar the values flowing from `origin` (the q chain, the
    latent's norm) are multiplied by in place (`x = x * self.<attr>`), None if none
    is. Which of those values are scaled is the proof's to check: it writes the scale
    out on the norm's output, as the generated file loads it."""
    derived: set[str] = set()
    found: set[str] = set()
    for assign in m.findall(fwd, m.Assign()):
        reads = {n.value for n in m.findall(assign.value, m.Name())}
        if not (m.findall(assign.value, origin) or reads & derived):
            continue
        targets = {
            n.value for t in assign.targets for n in m.findall(t.target, m.Name())
        }
        value = assign.value
        if (
            m.matches(value, m.BinaryOperation(operator=m.Multiply()))
            and len(targets) == 1
        ):
            sides = (value.left, value.right)
            attrs = [
                side.attr.value
                for side in sides
                if m.matches(side, _SELF) and side.attr.value not in modules
            ]
            if attrs and any(m.matches(side, m.Name(*targets)) for side in sides):
                found.add(attrs[0])
        derived |= targets
    if len(found) > 1:
        raise PatternRefused(
            f"the {what} is scaled by {sorted(found)}: one scale expected"
        )
    return next(iter(found), None)


def _is_linear(info: ClassInfo, attr: str) -> bool:
    try:
        _linear(info, attr)
    except PatternRefused:
        return False
    return True


def norm_class(info: ClassInfo, attr: str) -> str | None:
    """The class a norm attribute is built from (`Norm(n) if cond else None` too)."""
    calls = m.findall(info.attrs.get(attr, cst.Name("None")), m.Call(func=m.Name()))
    return calls[0].func.value if calls else None


def _direct_q(fwd: cst.FunctionDef, attr: str) -> bool:
    """`self.<attr>(hidden_states)` on the forward's input: the full-rank q projection."""
    first = fwd.params.params[1].name.value
    return bool(
        m.findall(
            fwd,
            m.Call(
                func=m.Attribute(value=m.Name("self"), attr=m.Name(attr)),
                args=[m.Arg(m.Name(first))],
            ),
        )
    )


def _functions(module: cst.Module | None) -> dict[str, cst.FunctionDef]:
    """The source file's module-level functions, by name."""
    if module is None:
        return {}
    return {s.name.value: s for s in module.body if isinstance(s, cst.FunctionDef)}


def _rope_style(
    fwd: cst.FunctionDef, functions: dict[str, cst.FunctionDef]
) -> cst.BaseExpression:
    """`is_neox_style` as an expression: pairs are rotated by an `...interleave`
    function, or by one multiplying complex numbers (`torch.view_as_complex` over
    pairs of the last dim: DeepSeek-V2); `if <test>: interleave else: halves` gives
    `not <test>`."""
    for node in m.findall(fwd, m.If()):
        body_calls = [c.func.value for c in m.findall(node.body, m.Call(func=m.Name()))]
        if any("interleave" in name for name in body_calls) and node.orelse is not None:
            return cst.parse_expression(f"not {code(node.test)}")
    names = [c.func.value for c in m.findall(fwd, m.Call(func=m.Name()))]
    complex_pairs = m.Call(
        func=m.Attribute(value=m.Name("torch"), attr=m.Name("view_as_complex"))
    )
    pairs = any("interleave" in n for n in names) or any(
        m.findall(functions[n], complex_pairs) for n in names if n in functions
    )
    return cst.Name("False" if pairs else "True")


def records(spec: MLASpec, scope: str) -> list[FusionRecord]:
    return [
        FusionRecord(
            NAME,
            spec.class_name,
            (spec.q_a, spec.kv_a),
            MERGED,
            "MergedColumnParallelLinear",
            (0, 1),
            scope,
        ),
        FusionRecord(
            NAME,
            spec.class_name,
            (spec.kv_a, spec.kv_norm, spec.kv_b, "rope", "attention"),
            "mla_attn",
            VLLM_CLASS,
            scope=scope,
            detail="latent KV cache",
        ),
    ]
