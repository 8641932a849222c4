"""Stage 2: match the fusion patterns and find each class's role in the model.

Roles are found from the source's own wiring, not from names: the attention class is
the one the QKV pattern matches, the decoder layer is the class that builds both the
attention and the MLP class, the base model builds an `nn.ModuleList` of decoder layers
and an `nn.Embedding`, and the causal LM builds the base model and the output head.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from fusion_patterns import glu, qkv, residual_norm, rms_norm
from fusion_patterns.base import ClassInfo, FusionRecord, Refusal, code, dotted_name, linear_args

from .errors import CodemodError
from .source import ModelSource

# torch.cat((-x2, x1), dim=-1): rotate_half over the two halves (GPT-NeoX style rotary)
NEOX_ROTATE = m.Call(
    func=m.Attribute(value=m.Name("torch"), attr=m.Name("cat")),
    args=[m.Arg(m.Tuple([m.Element(m.UnaryOperation(operator=m.Minus())), m.Element(m.Name())])), m.ZeroOrMore()],
)


@dataclass
class ModelStructure:
    source: ModelSource
    classes: dict[str, ClassInfo]
    norms: dict[str, rms_norm.NormSpec]
    attention: qkv.QKVSpec
    mlp: glu.GLUSpec
    layer: ClassInfo
    layer_spec: residual_norm.LayerSpec
    base: ClassInfo
    causal: ClassInfo
    # attribute names on the decoder layer
    attn_attr: str
    mlp_attr: str
    # attribute names on the base model and causal LM
    embed_attr: str
    layers_attr: str
    final_norm_attr: str
    model_attr: str
    head_attr: str
    num_layers: cst.BaseExpression
    neox_rotary: bool
    records: list[FusionRecord] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)


def cannot_generate(refusals: list[Refusal], why: str) -> CodemodError:
    """One line naming the refusal that stopped generation, latest first, then the rest
    (an earlier refusal is often the cause: a norm class refused makes its users fail)."""
    lines = [r.describe() for r in reversed(refusals)]
    return CodemodError(f"cannot generate: {'; after '.join(lines)} ({why})")


def class_infos(module: cst.Module) -> dict[str, ClassInfo]:
    out = {}
    for node in module.body:
        if not isinstance(node, cst.ClassDef):
            continue
        methods = {
            s.name.value: s for s in node.body.body if isinstance(s, cst.FunctionDef)
        }
        init = methods.get("__init__")
        attrs: dict[str, cst.BaseExpression] = {}
        if init is not None:
            for assign in m.findall(init, m.Assign(targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))])):
                attrs.setdefault(assign.targets[0].target.attr.value, assign.value)
        out[node.name.value] = ClassInfo(
            node=node,
            name=node.name.value,
            bases=tuple(filter(None, (dotted_name(b.value) for b in node.bases))),
            init=init,
            forward=methods.get("forward"),
            attrs=attrs,
        )
    return out


def _builders(info: ClassInfo, wanted: set[str]) -> dict[str, str]:
    """{attr: class} for the attributes of `info` built from one of `wanted`."""
    return {a: c for a in info.attrs if (c := info.constructed_class(a)) in wanted}


def _module_list_of(value: cst.BaseExpression, cls: str) -> cst.BaseExpression | None:
    """`nn.ModuleList([Cls(...) for i in range(N)])` -> N."""
    found = m.findall(
        value,
        m.ListComp(elt=m.Call(func=m.Name(cls)), for_in=m.CompFor(iter=m.Call(func=m.Name("range"), args=[m.Arg()]))),
    )
    return found[0].for_in.iter.args[0].value if found else None


def _one(kind: str, found: list, source: ModelSource):
    if not found:
        raise CodemodError(f"{source.display}: no {kind} found (is this a transformers causal LM modeling file?)")
    return found[0]


def analyse(source: ModelSource) -> ModelStructure:
    classes = class_infos(source.module)
    records: list[FusionRecord] = []
    refusals: list[Refusal] = []

    norms: dict[str, rms_norm.NormSpec] = {}
    for info in classes.values():
        result = rms_norm.match(info)
        if isinstance(result, Refusal):
            refusals.append(result)
        elif result is not None:
            norms[info.name] = result

    attentions, mlps = {}, {}
    for info in classes.values():
        for pattern, found, args in ((qkv, attentions, (norms,)), (glu, mlps, ())):
            result = pattern.match(info, *args)
            if isinstance(result, Refusal):
                refusals.append(result)
                raise cannot_generate(refusals, "no unfused form is emitted yet")
            if result is not None:
                found[info.name] = result

    layers = [
        info
        for info in classes.values()
        if _builders(info, set(attentions)) and _builders(info, set(mlps))
    ]
    layer = _one("decoder layer (a class building both an attention and an MLP class)", layers, source)
    attn_attr, attn_cls = next(iter(_builders(layer, set(attentions)).items()))
    mlp_attr, mlp_cls = next(iter(_builders(layer, set(mlps)).items()))

    bases = []
    for info in classes.values():
        for attr, value in info.attrs.items():
            count = _module_list_of(value, layer.name)
            embeds = [a for a in info.attrs if info.constructed_class(a) in ("nn.Embedding", "torch.nn.Embedding")]
            if count is not None and embeds:
                bases.append((info, attr, count, embeds[0]))
    base, layers_attr, num_layers, embed_attr = _one("base model (an nn.ModuleList of decoder layers)", bases, source)
    base_norms = [a for a, c in _builders(base, set(norms)).items()]
    final_norm_attr = _one("final norm on the base model", base_norms, source)

    causals = []
    for info in classes.values():
        model_attrs = [a for a, c in _builders(info, {base.name}).items()]
        heads = [a for a in info.attrs if info.constructed_class(a) in ("nn.Linear", "torch.nn.Linear")]
        if model_attrs and heads and info.name.endswith("ForCausalLM"):
            causals.append((info, model_attrs[0], heads[0]))
    causal, model_attr, head_attr = _one("...ForCausalLM class", causals, source)

    layer_result = residual_norm.match(layer, set(_builders(layer, set(norms))))
    if isinstance(layer_result, Refusal):
        refusals.append(layer_result)
        raise cannot_generate(refusals, "no unfused layer form is emitted yet")
    mixers = {b.mixer for b in layer_result.blocks}
    if mixers != {attn_attr, mlp_attr}:
        raise CodemodError(f"cannot generate: {layer.name} blocks call {sorted(mixers)}, expected {attn_attr} and {mlp_attr}")

    _refuse_unhandled_math(base, causal, source)

    rotates = m.findall(source.module, NEOX_ROTATE)
    neox = bool(rotates)

    attention, mlp = attentions[attn_cls], mlps[mlp_cls]
    for owner in (layer, base):
        for attr, cls in _builders(owner, set(norms)).items():
            records.append(rms_norm.record(norms[cls], owner.name, attr))
    records += qkv.records(attention, attn_attr)
    records += glu.records(mlp, mlp_attr)
    records += residual_norm.records(layer_result)

    return ModelStructure(
        source=source,
        classes=classes,
        norms=norms,
        attention=attention,
        mlp=mlp,
        layer=layer,
        layer_spec=layer_result,
        base=base,
        causal=causal,
        attn_attr=attn_attr,
        mlp_attr=mlp_attr,
        embed_attr=embed_attr,
        layers_attr=layers_attr,
        final_norm_attr=final_norm_attr,
        model_attr=model_attr,
        head_attr=head_attr,
        num_layers=num_layers,
        neox_rotary=neox,
        records=records,
        refusals=refusals,
    )


def _refuse_unhandled_math(base: ClassInfo, causal: ClassInfo, source: ModelSource) -> None:
    """Fail loudly on arithmetic around the embeddings or logits that is not emitted yet
    (an embedding normaliser, a logits multiplier or soft-cap): a model without it would
    load and run and be wrong."""
    for info, what in ((base, "embeddings or final hidden states"), (causal, "logits")):
        if info.forward is None:
            continue
        for op in m.findall(info.forward, m.BinaryOperation(operator=m.Multiply() | m.Divide())):
            raise CodemodError(f"cannot generate: {info.name}.forward scales the {what} (`{code(op)}`), not emitted yet")
        for call in m.findall(info.forward, m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("tanh")))):
            raise CodemodError(f"cannot generate: {info.name}.forward soft-caps the {what}, not emitted yet")
