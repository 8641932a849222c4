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

from fusion_patterns import glu, mla, model_scales, moe, qkv, residual_norm, rms_norm
from fusion_patterns.base import ClassInfo, PatternRefused, Refusal, dotted_name

from .errors import CodemodError
from .source import ModelSource

# torch.cat((-x2, x1), dim=-1): rotate_half over the two halves (GPT-NeoX style rotary)
NEOX_ROTATE = m.Call(
    func=m.Attribute(value=m.Name("torch"), attr=m.Name("cat")),
    args=[
        m.Arg(
            m.Tuple(
                [m.Element(m.UnaryOperation(operator=m.Minus())), m.Element(m.Name())]
            )
        ),
        m.ZeroOrMore(),
    ],
)

TORCH_NORMS = {"nn.LayerNorm", "torch.nn.LayerNorm"}
# config.rope_parameters[layer_type]: one rope per kind of layer (Gemma 3); an index by a
# name, not a string key such as ["rope_theta"]
ROPE_BY_LAYER_TYPE = m.Subscript(
    value=m.Attribute(attr=m.Name("rope_parameters")),
    slice=[m.SubscriptElement(m.Index(m.Name()))],
)


@dataclass
class ModelStructure:
    source: ModelSource
    classes: dict[str, ClassInfo]
    # proven RMSNorm classes; a norm class not in here is copied from the source as is
    norms: dict[str, rms_norm.NormSpec]
    attention: qkv.QKVSpec | mla.MLASpec
    # every class the decoder layer may build its MLP from (a dense MLP, a MoE block)
    # -> its fusion; None when the fusion was refused: that class is emitted unfused
    mlps: dict[str, glu.GLUSpec | moe.MoESpec | None]
    layer_spec: residual_norm.LayerSpec | None
    layer: ClassInfo
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
    rope_by_layer_type: bool
    embed_scale: model_scales.EmbeddingScale | None
    logits: model_scales.LogitsSpec
    refusals: list[Refusal] = field(default_factory=list)
    # {MLP class: its module paths in a decoder layer} ("mlp", "mlp.shared_experts"):
    # the stacked-weight keys of each fusion are scoped to these
    mlp_scopes: dict[str, list[str]] = field(default_factory=dict)
    # {unfused MLP class: (column-parallel, row-parallel) projections}, set by validation
    mlp_sharding: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)
    # checkpoint names transformers renames at load, set by validation (it loads the
    # source): {WeightsMapper field: {old: new}}
    checkpoint_renames: dict[str, dict[str, str]] = field(default_factory=dict)

    def rope_parameters(self, config, layer_idx: int) -> dict:
        """The rope parameters of layer `layer_idx`, as the source reads them."""
        if self.rope_by_layer_type:
            return config.rope_parameters[config.layer_types[layer_idx]]
        return config.rope_parameters

    def norm_attrs(
        self, owner: ClassInfo, *, proven_only: bool = True
    ) -> dict[str, str]:
        """{attr: norm class} of the norms `owner` builds."""
        wanted = set(self.norms) if proven_only else self.norm_like
        return _builders(owner, wanted)

    @property
    def norm_like(self) -> set[str]:
        """Every class that computes a norm, proven or not."""
        refused = {r.source_class for r in self.refusals if r.pattern == rms_norm.NAME}
        return set(self.norms) | refused | TORCH_NORMS

    def refuse(self, refusal: Refusal) -> None:
        self.refusals.append(refusal)


def cannot_generate(refusals: list[Refusal], why: str) -> CodemodError:
    """One line naming the refusal that stopped generation, latest first, then the rest
    (an earlier refusal is often the cause: a norm class refused makes its users fail).
    """
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
        choices: dict[str, list[cst.BaseExpression]] = {}
        if init is not None:
            for assign in m.findall(
                init,
                m.Assign(
                    targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))]
                ),
            ):
                attrs.setdefault(assign.targets[0].target.attr.value, assign.value)
                choices.setdefault(assign.targets[0].target.attr.value, []).append(
                    assign.value
                )
        out[node.name.value] = ClassInfo(
            node=node,
            name=node.name.value,
            bases=tuple(filter(None, (dotted_name(b.value) for b in node.bases))),
            init=init,
            forward=methods.get("forward"),
            attrs=attrs,
            choices=choices,
        )
    return out


def _builders(info: ClassInfo, wanted: set[str]) -> dict[str, str]:
    """{attr: class} for the attributes of `info` built from one of `wanted`."""
    return {a: c for a in info.attrs if (c := info.constructed_class(a)) in wanted}


def _module_list_of(value: cst.BaseExpression, cls: str) -> cst.BaseExpression | None:
    """`nn.ModuleList([Cls(...) for i in range(N)])` -> N."""
    found = m.findall(
        value,
        m.ListComp(
            elt=m.Call(func=m.Name(cls)),
            for_in=m.CompFor(iter=m.Call(func=m.Name("range"), args=[m.Arg()])),
        ),
    )
    return found[0].for_in.iter.args[0].value if found else None


def _one(kind: str, found: list, source: ModelSource):
    if not found:
        raise CodemodError(
            f"{source.display}: no {kind} found (is this a transformers causal LM modeling file?)"
        )
    return found[0]


def _match_mlp(
    info: ClassInfo, classes: dict[str, ClassInfo], refusals: list[Refusal]
) -> glu.GLUSpec | moe.MoESpec | None:
    """A MoE block, else a gated MLP; None (recorded) when a dense MLP is refused."""
    spec = moe.match(info, classes)
    if isinstance(spec, Refusal):
        refusals.append(spec)
        raise cannot_generate(refusals, "no unfused MoE form is emitted yet")
    if spec is None:
        spec = glu.match(info) or Refusal(
            glu.NAME,
            info.name,
            "gate/up projections",
            "forward has no `down(act(gate(x)) * up(x))` product",
        )
    if isinstance(spec, Refusal):
        refusals.append(spec)
        return None
    return spec


def analyse(source: ModelSource) -> ModelStructure:
    """Match every pattern and find the roles. Refusals of the MLP, norm and residual
    fusions leave those parts unfused; the attention has no unfused form yet."""
    classes = class_infos(source.module)
    refusals: list[Refusal] = []

    norms: dict[str, rms_norm.NormSpec] = {}
    for info in classes.values():
        result = rms_norm.match(info)
        if isinstance(result, Refusal):
            refusals.append(result)
        elif result is not None:
            norms[info.name] = result
    # torch's own LayerNorm counts as a norm too (kept as it is: GPT-NeoX)
    norm_like = set(norms) | {r.source_class for r in refusals} | TORCH_NORMS

    attentions = {}
    head_norms = {**{name: None for name in norm_like}, **norms}
    for info in classes.values():
        latent = mla.match(info, set(norms))
        if isinstance(latent, Refusal):
            refusals.append(latent)
            raise cannot_generate(refusals, "no unfused attention form is emitted yet")
        if latent is not None:
            attentions[info.name] = latent
            continue
        result = qkv.match(info, head_norms)
        if isinstance(result, Refusal):
            refusals.append(result)
            raise cannot_generate(refusals, "no unfused attention form is emitted yet")
        if result is not None:
            attentions[info.name] = result

    layers = [info for info in classes.values() if _builders(info, set(attentions))]
    layer = _one("decoder layer (a class building an attention class)", layers, source)
    attn_attr, attn_cls = next(iter(_builders(layer, set(attentions)).items()))
    others = {n for n in classes if n not in attentions and n not in norm_like}
    mlp_attrs = list(_builders(layer, others).items())
    if len(mlp_attrs) != 1:
        raise CodemodError(
            f"cannot generate: {layer.name} builds {len(mlp_attrs)} sublayers besides attention, expected one MLP"
        )
    mlp_attr = mlp_attrs[0][0]
    mlps = {}
    for cls in layer.constructed_classes(mlp_attr):
        if cls not in classes:
            raise CodemodError(
                f"cannot generate: {layer.name}.{mlp_attr} may be a {cls}, not a class of the source"
            )
        mlps[cls] = _match_mlp(classes[cls], classes, refusals)
    mlp_scopes = {cls: [mlp_attr] for cls in mlps}
    for spec in list(mlps.values()):
        if isinstance(spec, moe.MoESpec) and spec.shared_class:
            # shared experts: a dense MLP inside the MoE block, emitted and proven too
            if spec.shared_class not in mlps:
                mlps[spec.shared_class] = _match_mlp(
                    classes[spec.shared_class], classes, refusals
                )
            mlp_scopes.setdefault(spec.shared_class, []).append(
                f"{mlp_attr}.{spec.shared_attr}"
            )

    bases = []
    for info in classes.values():
        for attr, value in info.attrs.items():
            count = _module_list_of(value, layer.name)
            embeds = [
                a
                for a in info.attrs
                if model_scales.is_embedding(info.constructed_class(a), classes)
            ]
            if count is not None and embeds:
                bases.append((info, attr, count, embeds[0]))
    base, layers_attr, num_layers, embed_attr = _one(
        "base model (an nn.ModuleList of decoder layers)", bases, source
    )
    final_norm_attr = _one(
        "final norm on the base model", list(_builders(base, norm_like)), source
    )

    causals = []
    for info in classes.values():
        model_attrs = list(_builders(info, {base.name}))
        heads = [
            a
            for a in info.attrs
            if info.constructed_class(a) in ("nn.Linear", "torch.nn.Linear")
        ]
        if model_attrs and heads and info.name.endswith("ForCausalLM"):
            causals.append((info, model_attrs[0], heads[0]))
    causal, model_attr, head_attr = _one("...ForCausalLM class", causals, source)

    layer_spec = residual_norm.match(
        layer, set(_builders(layer, set(norms))), set(_builders(layer, norm_like))
    )
    if isinstance(layer_spec, Refusal):
        refusals.append(layer_spec)
        layer_spec = None
    elif {b.mixer for b in layer_spec.blocks} != {attn_attr, mlp_attr}:
        raise CodemodError(
            f"cannot generate: {layer.name} blocks do not call {attn_attr} and {mlp_attr}"
        )

    try:
        embed_scale = model_scales.embedding_scale(base, embed_attr, classes)
        logits = model_scales.logits_spec(causal, head_attr)
    except PatternRefused as why:
        # a model without this arithmetic would load and run and be wrong
        raise CodemodError(f"cannot generate: {why}, not emitted yet") from None

    return ModelStructure(
        source=source,
        classes=classes,
        norms=norms,
        attention=attentions[attn_cls],
        mlps=mlps,
        mlp_scopes=mlp_scopes,
        layer_spec=layer_spec,
        layer=layer,
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
        neox_rotary=bool(m.findall(source.module, NEOX_ROTATE)),
        rope_by_layer_type=bool(m.findall(source.module, ROPE_BY_LAYER_TYPE)),
        embed_scale=embed_scale,
        logits=logits,
        refusals=refusals,
    )
