"""The faithful tier end to end: source -> roles -> probe -> proofs -> emit.

Every class of the model is emitted from its own source (rewrite.py); a class a fusion
pattern proves is emitted in its fused form instead (norms, gated MLPs, MoE blocks), so
fusion is per part. Roles come from the source's own wiring and its tiny model: the
causal LM builds the base model, the base model holds the `nn.ModuleList` of layers,
an attention class calls transformers' attention interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import libcst as cst
import libcst.matchers as m

from fusion_patterns import glu, moe, qkv, rms_norm
from fusion_patterns.base import (
    ClassInfo,
    FusionRecord,
    PatternRefused,
    Refusal,
    code,
    dotted_name,
    linear_args,
)

from .. import layer_kinds, loading, tiny
from ..emit import imports_for
from ..emit import mlp as mlp_emit
from ..emit import moe as moe_emit
from ..errors import CodemodError
from ..source import ModelSource
from ..structure import TORCH_NORMS, class_infos
from . import (
    compile_check,
    attention,
    definitions,
    eager_attention,
    positions,
    probe,
    tp,
    weights,
)
from . import rewrite as rewrite_module
from .model import BaseRoles, CausalRoles, emit_base, emit_causal, mask_functions
from .rewrite import (
    LINEARS,
    VLLM_ATTENTION_HELPER,
    Context,
    kept_linears,
    prefix_classes,
    rewrite_class,
)

LAYOUT = "faithful"

WRAPPER = """
class {name}(nn.Module):
    # a pass-through around the module holding the layers, as in the source
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config
        self.{attr} = {inner}(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "{attr}"))
        self.make_empty_intermediate_tensors = self.{attr}.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.{attr}.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.{attr}(input_ids, positions, intermediate_tensors, inputs_embeds)
"""


@dataclass
class Unfused:
    """A part emitted as the source computes it (no pattern proved a fused form)."""

    source_class: str
    what: str
    reason: str

    def describe(self) -> str:
        return " ".join(
            f"Unfused: {self.what} ({self.source_class}): {self.reason}".split()
        )


@dataclass
class FaithfulPlan:
    source: ModelSource
    causal_name: str
    records: list[FusionRecord] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    unfused: list[Unfused] = field(default_factory=list)
    layout: str = LAYOUT
    why_faithful: str = ""
    # environment vLLM must run the file with (a model type vLLM treats as MLA)
    environment: dict = field(default_factory=dict)

    def report(self) -> list[str]:
        return (
            [r.describe() for r in self.records]
            + [u.describe() for u in self.unfused]
            + [r.describe() for r in self.refusals]
        )

    def packed_modules_mapping(self) -> dict[str, list[str]]:
        return {
            r.target: list(r.sources)
            for r in self.records
            if r.stacks_weights or r.packed
        }

    def stacked_params(self):
        return [
            (f".{scope}.{source}.", f".{scope}.{r.target}.", shard)
            for r, scope in self._scoped
            for source, shard in zip(r.sources, r.shard_ids)
        ]

    _scoped: list = field(default_factory=list)


def pick_causal(pymodule, classes: dict[str, ClassInfo], source: ModelSource):
    """The causal LM class of a text decoder the file defines."""
    import torch.nn as nn
    from transformers import PreTrainedModel

    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as MAPPING,
        )
    except ImportError:  # pragma: no cover
        MAPPING = {}
    mapped = set(MAPPING.values())
    found = []
    for name in classes:
        obj = getattr(pymodule, name, None)
        if not isinstance(obj, type) or not issubclass(obj, PreTrainedModel):
            continue
        if not (name.endswith("ForCausalLM") or name.endswith("LMHeadModel")):
            continue
        config_cls = getattr(obj, "config_class", None)
        if config_cls is None or _multimodal(config_cls):
            continue
        found.append((name not in mapped, name, obj))
    if not found:
        raise CodemodError(
            f"{source.display}: no text causal LM class (…ForCausalLM / …LMHeadModel) found"
        )
    return sorted(found, key=lambda t: (t[0], classes_order(classes, t[1])))[0][2]


def _multimodal(config_cls) -> bool:
    """A config that wraps a text config (a vision-language model's) is not a text decoder."""
    try:
        config = config_cls()
        return config.get_text_config() is not config
    except Exception:
        return bool(getattr(config_cls, "sub_configs", None))


def classes_order(classes, name) -> int:
    return list(classes).index(name)


def _build_tiny(causal_cls, values: dict | None = None):
    import torch

    try:
        if values is None:
            values = tiny.working_values(causal_cls)
        config = causal_cls.config_class(**values)
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = causal_cls(config).float().eval()
    except Exception as exc:
        raise CodemodError(
            f"cannot build a tiny {causal_cls.__name__} from the source: "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from None
    tiny.randomize(model)
    return config, model


def _first_line(exc) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def _constructed(info: ClassInfo) -> list[str]:
    if info.init is None:
        return []
    return [n for c in m.findall(info.init, m.Call()) if (n := dotted_name(c.func))]


def _reachable(start: str, classes: dict[str, ClassInfo]) -> list[str]:
    seen: list[str] = []
    stack = [start]
    while stack:
        name = stack.pop()
        if name in seen or name not in classes:
            continue
        seen.append(name)
        info = classes[name]
        stack += [b for b in info.bases if b in classes]
        stack += [c for c in _constructed(info) if c in classes]
    return seen


def generate(
    source: ModelSource,
    trust_remote_code: bool = False,
    fuse: bool = True,
    why: str = "",
    values: dict | None = None,
):
    """(plan, unformatted body) of the faithful file for `source` (its tiny model built
    from `values`, default `tiny.working_values`)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    # vLLM's layers (the fused forms the proofs run) read the current config when built
    with set_current_vllm_config(VllmConfig()):
        return _generate(source, trust_remote_code, fuse, why, values)


def _generate(
    source: ModelSource, trust_remote_code: bool, fuse: bool, why: str, values
):
    import torch.nn as nn
    from transformers import PreTrainedModel

    pymodule = loading.load_module(source, trust_remote_code)
    classes = class_infos(source.module)
    rewrite_module.ATTENTION_NAME[0] = (
        "VllmAttention" if "Attention" in classes else "Attention"
    )
    defs = definitions.collect(source)
    causal_cls = pick_causal(pymodule, classes, source)
    # attention classes keep their __init__ locals while the tiny model is built
    candidates = [
        info
        for info in classes.values()
        if info.forward is not None
        and (probe.interface_call(info.forward) or eager_attention.find(info))
    ]
    with probe.init_locals(pymodule, candidates):
        config, model = _build_tiny(causal_cls, values)
    layer_kinds.refuse_encoder_decoder(causal_cls, config)

    # roles, from the instance: the module holding the layer list is the base model
    # (vLLM's interface, pipeline stages); PreTrainedModels between it and the causal LM
    # (OPT's OPTModel around its OPTDecoder) are pass-through wrappers
    causal = classes[causal_cls.__name__]
    n_layers = getattr(config, "num_hidden_layers", None)
    lists = [
        (path, mod)
        for path, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList)
        and len(mod) == n_layers
        and path.count(".") >= 1
    ]
    if len(lists) != 1:
        raise CodemodError(
            f"cannot generate: {causal.name} holds {len(lists)} lists of {n_layers} layers, expected one"
        )
    layers_path, layer_list = lists[0]
    chain = layers_path.split(".")[:-1]
    layers_attr = layers_path.split(".")[-1]
    base_attr = chain[0]
    base_mod = model.get_submodule(".".join(chain))
    wrappers = [
        (chain[i + 1], model.get_submodule(".".join(chain[: i + 1])))
        for i in range(len(chain) - 1)
    ]
    base = classes.get(type(base_mod).__name__)
    if base is None or not isinstance(base_mod, PreTrainedModel):
        raise CodemodError(
            f"cannot generate: the layers' owner {type(base_mod).__name__} is not a model class of {source.display}"
        )
    for _, wrapper in wrappers:
        if type(wrapper).__name__ not in classes:
            raise CodemodError(
                f"cannot generate: {type(wrapper).__name__} is not defined in {source.display}"
            )
    layer_classes = list(dict.fromkeys(type(x).__name__ for x in layer_list))
    wanted = _reachable(causal.name, classes)
    # classes built indirectly (`CLASSES[config._attn_implementation](config)`): the
    # tiny model says which
    for mod in model.modules():
        name = type(mod).__name__
        if name in classes and name not in wanted:
            wanted += [c for c in _reachable(name, classes) if c not in wanted]
    # attention: classes calling transformers' attention interface
    attention_infos = {
        n: classes[n]
        for n in wanted
        if classes[n].forward is not None and probe.interface_call(classes[n].forward)
    }
    in_layers = {type(x).__name__ for layer in layer_list for x in layer.modules()}
    # a model's own attention (no interface): its core, found in the source
    eager_cores = {
        n: core
        for n in wanted
        if n not in attention_infos
        and n in in_layers
        and (core := eager_attention.find(classes[n])) is not None
    }
    attention_like = set(attention_infos) | set(eager_cores)
    for i, layer in enumerate(layer_list):
        if not any(type(x).__name__ in attention_like for x in layer.modules()):
            raise CodemodError(
                f"out of scope: layer {i} ({type(layer).__name__}) has no attention-interface "
                "call (a mixer vLLM's Transformers backend cannot serve either)"
            )
        convs = [type(x).__name__ for x in layer.modules() if isinstance(x, nn.Conv1d)]
        if convs:
            raise CodemodError(
                f"out of scope: layer {i} holds a convolution ({convs[0]}), a mixer that is not attention"
            )
    # the layer list's shape, after the scope checks: a hybrid (Mamba) model says so
    layers_value = base.attrs.get(layers_attr)
    comp = m.findall(layers_value, m.ListComp()) if layers_value is not None else []
    if not comp or not isinstance(comp[0].elt, cst.Call):
        raise CodemodError(
            f"cannot generate: {base.name}.{layers_attr} is not built as `nn.ModuleList([Layer(...) for i in range(n)])`"
        )
    comp = comp[0]
    if not m.matches(comp.for_in.iter, m.Call(func=m.Name("range"), args=[m.Arg()])):
        raise CodemodError(
            f"cannot generate: {base.name}.{layers_attr} is not built over range(<layers>)"
        )

    records: dict[str, list] = {n: [] for n in eager_cores}
    patches = [
        eager_attention.instrumented(
            pymodule, getattr(pymodule, n), core, classes[n], records[n]
        )
        for n, core in eager_cores.items()
    ]
    # TP: transformers' own plan of the config class, per class attribute
    styles = _tp_styles(config, model, base_attr, classes)
    try:
        pr = probe.run(
            pymodule,
            model,
            config,
            attention_infos,
            config.vocab_size,
            patches,
            set(styles) | set(attention_infos),
        )
    except CodemodError:
        raise
    except Exception as exc:
        raise CodemodError(
            f"cannot run a tiny {causal.name} from the source: {type(exc).__name__}: {_first_line(exc)}"
        ) from None
    specs = {
        n: attention.infer(info, pr.calls_of(n), config, pymodule)
        for n, info in attention_infos.items()
        if n in in_layers
    }
    for n, core in eager_cores.items():
        specs[n] = eager_attention.infer(
            classes[n], core, records[n], config, pymodule, probe.PROBE_TOKENS
        )

    plan = FaithfulPlan(source=source, causal_name=causal.name, why_faithful=why)
    if why:
        plan.unfused.append(Unfused(causal.name, "native layout", why))
    # fused tier on top: norms, gated MLPs, MoE blocks the patterns prove
    norms: dict[str, rms_norm.NormSpec] = {}
    fused_mlp: dict[str, object] = {}
    if fuse:
        for n in wanted:
            info = classes[n]
            result = rms_norm.match(info)
            if result is None:
                continue
            inst = pr.first(n)
            if isinstance(result, Refusal):
                plan.refusals.append(result)
                continue
            if inst is None:
                continue
            try:
                rms_norm.prove(result, inst)
                norms[n] = result
            except PatternRefused as exc:
                plan.refusals.append(Refusal(rms_norm.NAME, n, n, str(exc)))
        skip = (
            set(attention_infos)
            | set(norms)
            | {causal.name, base.name}
            | set(layer_classes)
        )
        for n in wanted:
            if n in skip or n not in in_layers:
                continue
            info = classes[n]
            inst = pr.first(n)
            spec = moe.match(info, classes)
            kind = moe
            if spec is None:
                spec = glu.match(info)
                kind = glu
            if spec is None or inst is None:
                continue
            if isinstance(spec, Refusal):
                plan.refusals.append(spec)
                continue
            what = "router + experts" if kind is moe else "gate/up projections"
            try:
                kind.prove(spec, inst, config)
                fused_mlp[n] = spec
            except PatternRefused as exc:
                plan.refusals.append(Refusal(kind.NAME, n, what, str(exc)))
            except Exception as exc:  # a proof that cannot even run is a refusal
                plan.refusals.append(
                    Refusal(
                        kind.NAME,
                        n,
                        what,
                        f"proof failed to run: {type(exc).__name__}: {_first_line(exc)}",
                    )
                )

    # scopes of each class below a decoder layer, for stacked-weight keys
    scopes: dict[str, list[str]] = {}
    for path, mod in model.named_modules():
        parts = path.split(".")
        if layers_attr in parts:
            i = parts.index(layers_attr)
            scope = ".".join(parts[i + 2 :])
            if scope:
                scopes.setdefault(type(mod).__name__, [])
                if scope not in scopes[type(mod).__name__]:
                    scopes[type(mod).__name__].append(scope)

    for n, spec in norms.items():
        for owner in wanted:
            for attr in classes[owner].attrs:
                if classes[owner].constructed_class(attr) == n:
                    plan.records.append(rms_norm.record(spec, owner, attr))
    for n, spec in fused_mlp.items():
        for scope in scopes.get(n, [""]):
            found = (
                moe.records(spec, scope)
                if isinstance(spec, moe.MoESpec)
                else glu.records(spec, scope)
            )
            plan.records += found
            plan._scoped += [(r, scope) for r in found if r.stacks_weights]

    # q/k/v the QKV pattern proves merge into one QKVParallelLinear, which shards by
    # heads: the class must then shard (its plan, or q/k/v column- and the output
    # row-parallel where it has none), proven like any plan below
    qkv_specs: dict[str, qkv.QKVSpec] = {}
    if fuse:
        norm_like = {n for n, i in classes.items() if rms_norm.match(i) is not None}
        head_norms = {**{n: None for n in norm_like | TORCH_NORMS}, **norms}
        kept = kept_linears(source.module, classes)
        for n, spec in specs.items():
            if spec.eager is not None:
                continue
            found = qkv.match(classes[n], head_norms)
            if not isinstance(found, qkv.QKVSpec):
                if isinstance(found, Refusal):
                    plan.refusals.append(found)
                continue
            if found.packed or set(found.projections) & kept:
                continue
            try:
                qkv.prove_dataflow(found, pr.first(n))
                qkv.prove_merged_gemm(found, pr.first(n), config)
            except PatternRefused as exc:
                plan.refusals.append(
                    Refusal(qkv.NAME, n, "q/k/v projections", str(exc))
                )
                continue
            except Exception as exc:  # a proof that cannot run is a refusal
                plan.refusals.append(
                    Refusal(
                        qkv.NAME,
                        n,
                        "q/k/v projections",
                        f"proof failed to run: {type(exc).__name__}: {_first_line(exc)}",
                    )
                )
                continue
            if not styles.get(n):
                styles[n] = {
                    **{p: "colwise" for p in found.projections},
                    found.out_proj: "rowwise",
                }
            qkv_specs[n] = found
    # ... kept for a class only where sharding it over two simulated ranks is proven
    tp_notes: list[Unfused] = []
    for n in list(styles):
        inst = pr.first(n)
        spec = specs.get(n)
        why = (
            tp.prove(
                inst,
                styles[n],
                spec.head_attrs if spec else [],
                pr.module_calls.get(id(inst)),
                spec.sinks if spec else None,
            )
            if inst is not None
            else "no instance in the tiny model"
        )
        if why is not None:
            del styles[n]
            tp_notes.append(Unfused(n, "tensor parallel", f"replicated: {why}"))
    sharded = {
        n for n in specs if any(s == "colwise" for s in styles.get(n, {}).values())
    }
    for n, found in qkv_specs.items():
        if n in sharded and all(
            styles[n].get(p) == "colwise" for p in found.projections
        ):
            specs[n].qkv = found
            for scope in scopes.get(n, [""]):
                rec = qkv.records(found, scope, set())[0]
                plan.records.append(rec)
                plan._scoped.append((rec, scope))
    fused_names = set(fused_mlp)
    _WRAPPERS.clear()
    _WRAPPERS.update(type(w).__name__ for _, w in wrappers)
    emitted = [
        n
        for n in wanted
        if n not in norms
        and not _is_pretrained_helper(n, classes, pymodule, causal.name, base.name)
    ]
    vocab_attr = _vocab_embedding(base_mod, config)
    vocab_class = type(_get(base_mod, vocab_attr)).__name__
    rebased = {vocab_class} if vocab_class in classes else set()
    built = {}
    for n in emitted:
        inst = pr.first(n)
        if inst is None:
            continue
        for attr, child in inst.named_children():
            if (
                type(child).__name__ in classes
                and classes[n].constructed_class(attr) is None
            ):
                built[(n, attr)] = type(child).__name__
    ctx = Context(
        classes=classes,
        norms=norms,
        built=built,
        prefix_classes=prefix_classes(classes, set(emitted), fused_names, specs, built)
        | rebased,
        attention=specs,
        styles=styles,
        kept_linears=kept_linears(source.module, classes),
        sharded_attention=sharded,
    )
    ctx.mask_functions = mask_functions(defs.imports)

    head_attr = _head(causal, model, config)
    tied_keys = getattr(causal_cls, "_tied_weights_keys", None) or {}
    tied_embedding = None
    if isinstance(tied_keys, dict):
        for k, v in tied_keys.items():
            if k.split(".")[0] == head_attr:
                tied_embedding = v.rsplit(".", 1)[0]
    elif tied_keys:
        tied_embedding = ".".join([*chain, vocab_attr])

    placement = _placement(base, base_mod, layers_attr)
    top = vocab_attr.split(".")[0]
    if tied_embedding is not None and placement.get(top) == "first":
        placement[top] = "first+tied"
    base_roles = BaseRoles(
        info=base,
        embed_attr=vocab_attr,
        layers_attr=layers_attr,
        layer_classes=layer_classes,
        num_layers=comp.for_in.iter.args[0].value,
        layer_call_args=comp.elt,
        loop_var=code(comp.for_in.target),
        placement=placement,
        tied=tied_embedding is not None,
    )
    head_call = causal.attrs[head_attr]
    in_size, _, bias = linear_args(head_call)
    causal_roles = CausalRoles(
        info=causal,
        model_attr=base_attr,
        base_name=type(getattr(model, base_attr)).__name__,
        head_attr=head_attr,
        head_bias=code(bias) != "False",
        vocab=linear_args(head_call)[1],
        hidden=in_size,
        tied_embedding=tied_embedding,
        last_rank_attrs={
            a
            for a, child in model.named_children()
            if a not in (base_attr, head_attr) and any(True for _ in child.parameters())
        },
    )

    pieces: dict[str, str] = {}
    wrapper_names = {type(w).__name__ for _, w in wrappers}
    for n in emitted:
        if n in (causal.name, base.name) or n in wrapper_names:
            continue
        info = classes[n]
        if n in fused_mlp:
            spec = fused_mlp[n]
            if isinstance(spec, moe.MoESpec):
                pieces[n] = moe_emit.emit(info, spec)
            else:
                pieces[n] = mlp_emit.emit(info, spec)
            continue
        rebase = "VocabParallelEmbedding" if n in rebased else None
        pieces[n] = rewrite_class(info, ctx, base=rebase)
        if (found := positions.still_used(info, pieces[n])) is not None:
            raise CodemodError(
                f"cannot generate: {n} counts positions from the cache's length "
                f"(`{' '.join(found.split())}`), which vLLM hands no module: under vLLM "
                "they would restart at 0 on every decode step"
            )
        plan.unfused.append(
            _unfused_line(n, info, specs, classes, plan.refusals, layer_classes)
        )
    plan.unfused += tp_notes
    if _vllm_assumes_mla(config):
        plan.environment["VLLM_MLA_DISABLE"] = "1"
        plan.unfused.append(
            Unfused(
                causal.name,
                "latent attention",
                "its attention is emitted from the source on vLLM's standard attention "
                "(expanded keys and values), so vLLM's MLA path must be off: VLLM_MLA_DISABLE=1",
            )
        )
        causal_roles.require_no_mla = True
    pieces[base.name] = emit_base(base_roles, ctx)
    for inner_attr, wrapper in wrappers:
        inner = type(getattr(wrapper, inner_attr)).__name__
        extra = [
            a
            for a, child in wrapper.named_children()
            if a != inner_attr and any(True for _ in child.parameters())
        ]
        if extra:
            raise CodemodError(
                f"cannot generate: {type(wrapper).__name__} holds {extra[0]} besides its {inner_attr}"
            )
        pieces[type(wrapper).__name__] = WRAPPER.format(
            name=type(wrapper).__name__, attr=inner_attr, inner=inner
        )
    renames, stacking = weights.conversions(causal_cls, config.model_type)
    mapper, layout_methods, weights_arg = weights.loader_code(
        renames, stacking, plan.stacked_params()
    )
    pieces[causal.name] = emit_causal(
        causal_roles,
        ctx,
        plan.packed_modules_mapping(),
        mapper,
        layout_methods,
        weights_arg,
    )
    order = list(classes)
    body_classes = "\n\n".join(pieces[n] for n in sorted(pieces, key=order.index))
    helper = (
        VLLM_ATTENTION_HELPER if any(sp.eager is None for sp in specs.values()) else ""
    )
    if any(sp.eager is not None for sp in specs.values()):
        helper += eager_attention.HELPER
    helper = helper.replace(
        "attn: Attention", f"attn: {rewrite_module.ATTENTION_NAME[0]}"
    )
    for name, text in eager_attention.ALIBI_HELPERS.items():
        if any(sp.alibi and f"{name}(" in sp.alibi for sp in specs.values()):
            helper += text
    body = helper + "\n\n" + body_classes
    head = imports_for(body, set(classes))
    copied, imports = definitions.closure(
        defs,
        head + body,
        set(pieces)
        | {"vllm_attention", "vllm_attention_heads", *eager_attention.ALIBI_HELPERS},
    )
    copied_text = definitions.copied_text(defs, copied)
    # definitions in source order among the classes (constants may name classes)
    blocks = []
    for name in order_all(defs, copied, pieces):
        blocks.append(
            pieces[name] if name in pieces else copied_text[copied.index(name)]
        )
    body = "\n\n".join([helper, *blocks])
    dynamic = compile_check.data_dependent(body)
    if dynamic:
        owner, construct = dynamic[0]
        body = body.replace(
            f"@support_torch_compile\nclass {base.name}(", f"class {base.name}(", 1
        )
        plan.unfused.append(
            Unfused(
                base.name,
                "torch.compile",
                f"off: {owner} has a data-dependent shape ({construct}), which one "
                "captured graph cannot hold; the model runs eagerly",
            )
        )
        head = head.replace(
            "from vllm.compilation.decorators import support_torch_compile\n", ""
        )
    extra_imports = "\n".join(i for i in imports if not _provided(i, head))
    text = head + ("\n" + extra_imports + "\n" if extra_imports else "") + "\n\n" + body
    return plan, text


_WRAPPERS: set[str] = set()


def order_all(defs, copied: list[str], pieces: dict[str, str]) -> list[str]:
    names = [n for n in defs.order if n in pieces or n in copied]
    return list(dict.fromkeys(names))


def _provided(line: str, head: str) -> bool:
    return line in head.splitlines()


def _is_pretrained_helper(name, classes, pymodule, causal, base) -> bool:
    """PreTrainedModel subclasses other than the base model and the causal LM (the
    `XPreTrainedModel` weight-init base) are not emitted."""
    from transformers import PreTrainedModel

    if name in (causal, base):
        return False
    if name in _WRAPPERS:
        return False
    obj = getattr(pymodule, name, None)
    return isinstance(obj, type) and issubclass(obj, PreTrainedModel)


def _vllm_assumes_mla(config) -> bool:
    """Whether vLLM's own config logic will set up this model type for MLA."""
    from vllm.transformers_utils.model_arch_config_convertor import (
        ModelArchConfigConvertorBase,
    )

    try:
        return bool(ModelArchConfigConvertorBase(config, config).is_deepseek_mla())
    except Exception:
        return False


def _get(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _vocab_embedding(base_mod, config) -> str:
    """The vocabulary embedding's path below the base model (a direct child, or inside
    an embeddings module)."""
    import torch.nn as nn

    for attr, child in base_mod.named_modules():
        if (
            isinstance(child, nn.Embedding)
            and child.num_embeddings == config.vocab_size
        ):
            return attr
    raise CodemodError(
        f"cannot generate: {type(base_mod).__name__} holds no vocabulary embedding"
    )


def _is_vocab_embedding_class(name, base_mod, vocab_attr) -> bool:
    import torch.nn as nn

    child = getattr(base_mod, vocab_attr)
    return type(child).__name__ == name and type(child) is not nn.Embedding


def _head(causal: ClassInfo, model, config) -> str:
    import torch.nn as nn

    for attr, child in model.named_children():
        if isinstance(child, nn.Linear) and child.out_features == config.vocab_size:
            if causal.constructed_class(attr) in LINEARS:
                return attr
    raise CodemodError(
        f"cannot generate: {causal.name} builds no nn.Linear vocabulary head"
    )


def _placement(base: ClassInfo, base_mod, layers_attr: str) -> dict[str, str]:
    """Which pipeline ranks build each module of the base model: those with parameters
    before the layers on the first, after them on the last; parameter-free ones (rotary
    tables, dropout) everywhere."""
    order = list(base.attrs)
    if layers_attr not in order:
        return {}
    at = order.index(layers_attr)
    out = {}
    for i, attr in enumerate(order):
        child = getattr(base_mod, attr, None)
        if child is None or not hasattr(child, "parameters"):
            continue
        has_params = any(True for _ in child.parameters()) or any(
            True for _ in child.buffers() if False
        )
        if not has_params:
            out[attr] = "every"
        elif i < at:
            out[attr] = "first"
        elif i > at:
            out[attr] = "last"
    return out


def _tp_styles(config, model, base_attr, classes) -> dict[str, dict[str, str]]:
    """{class: {linear attr: style}} from the config class's `base_model_tp_plan`; a
    class used under paths the plan shards differently is replicated."""
    import fnmatch

    import torch.nn as nn

    plan = (
        getattr(type(config), "base_model_tp_plan", None)
        or getattr(config, "base_model_tp_plan", None)
        or {}
    )
    seen: dict[str, dict[str, set[str]]] = {}
    base = getattr(model, base_attr)
    for path, mod in base.named_modules():
        cls = type(mod).__name__
        if cls not in classes:
            continue
        for attr, child in mod.named_children():
            if not isinstance(child, nn.Linear):
                continue
            full = f"{path}.{attr}" if path else attr
            style = "replicate"
            for pattern, s in plan.items():
                if fnmatch.fnmatchcase(
                    full, pattern.replace("*", "[0-9]*")
                ) or fnmatch.fnmatchcase(full, pattern):
                    style = s
                    break
            seen.setdefault(cls, {}).setdefault(attr, set()).add(style)
    out: dict[str, dict[str, str]] = {}
    for cls, attrs in seen.items():
        if any(len(s) > 1 for s in attrs.values()):
            continue  # sharded in one place, not in another: replicated everywhere
        styles = {a: next(iter(s)) for a, s in attrs.items()}
        known = {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input"}
        if all(s in known or s == "replicate" for s in styles.values()):
            out[cls] = {a: s for a, s in styles.items() if s in known}
    return out


def _unfused_line(n, info, specs, classes, refusals, layer_classes) -> Unfused:
    refused = [r for r in refusals if r.source_class == n]
    why = refused[0].reason if refused else None
    if n in specs:
        return Unfused(
            n, "attention", "kept as the source computes it; " + specs[n].describe()
        )
    if n in layer_classes:
        return Unfused(
            n,
            "decoder layer",
            "its forward as the source writes it (residual adds, norms, sublayer calls)",
        )
    return Unfused(n, "module", "copied from the source" + (f" ({why})" if why else ""))
