"""Stage 3: what each class is in the model, found from the tiny instance and the
source's wiring, never from names.

The causal LM builds the base model; the base model is the module holding the one
`nn.ModuleList` of as many layers as the config says (modules between it and the causal
LM are pass-through wrappers: OPT's `OPTModel` around its `OPTDecoder`); the vocabulary
embedding is the `nn.Embedding` of `vocab_size` rows below it, the head the causal LM's
`nn.Linear` onto the vocabulary. An attention class calls transformers' attention
interface, or computes attention itself (a softmax between two matmuls); what vLLM's
`Attention` must be told about each (heads, scale, window, soft-cap, sinks, ALiBi,
chunks) is read from what every layer handed it in the probe, and proven.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import LINEARS, ClassInfo, ClassTable, code, dotted_name
from fusion_patterns.base import linear_args

from .copying import attention as attention_args
from .copying import eager_attention
from .copying.simplify import Substitute
from .errors import CodemodError
from .attention_calls import interface_call
from .probe import PROBE_TOKENS, Probe
from .source import ModelSource


@dataclass
class Roles:
    causal: ClassInfo
    base: ClassInfo
    base_attr: str  # the causal LM's attribute holding the base model (or its wrapper)
    chain: list[str]  # attribute path from the causal LM to the base model
    wrappers: list[tuple[str, object]]  # (inner attribute, wrapper instance)
    layers_attr: str
    layer_classes: list[str]
    layers_comprehension: cst.ListComp | None  # `[Layer(...) for i in range(n)]`
    wanted: list[str]  # every class of the source the model may build
    in_layers: set[str]  # classes instantiated inside a decoder layer
    # copied attention classes -> what vLLM's Attention is told for each
    attention: dict[str, attention_args.AttentionSpec]
    # {class: its module paths below a decoder layer} ("mlp", "mlp.shared_experts"):
    # the stacked-weight keys of each fusion are scoped to these
    scopes: dict[str, list[str]]
    vocab_attr: str  # below the base model
    vocab_class: str
    head_attr: str
    tied_embedding: str | None  # the embedding's path below the causal LM
    # base model attribute -> "first" | "last" | "every": which pipeline ranks build it
    placement: dict[str, str]
    # (class, attr) -> the source class the tiny model built there, for constructions
    # through a lookup (`CLASSES[config._attn_implementation](config)`)
    built: dict[tuple[str, str], str] = field(default_factory=dict)
    # (class, attr) -> a class table it is built from per layer
    # (`self.mixer = MIXER_TYPES[self.block_type](config, ...)`)
    tables: dict[tuple[str, str], ClassTable] = field(default_factory=dict)
    # module attributes of the causal LM besides the base model and the head
    last_rank_attrs: set[str] = field(default_factory=set)
    # the base model's method building the layer list, where a comprehension does not
    layers_method: cst.FunctionDef | None = None

    @property
    def wrapper_names(self) -> set[str]:
        return {type(w).__name__ for _, w in self.wrappers}


def causal_class(pymodule, classes: dict[str, ClassInfo], source: ModelSource):
    """The causal LM class of a text decoder the file defines."""
    from transformers import PreTrainedModel

    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as MAPPING,
        )
    except ImportError:  # pragma: no cover
        MAPPING = {}
    mapped = set(MAPPING.values())
    found, multimodal = [], []
    for name in classes:
        obj = getattr(pymodule, name, None)
        if not isinstance(obj, type) or not issubclass(obj, PreTrainedModel):
            continue
        if not (
            name.endswith("ForCausalLM")
            or name.endswith("LMHeadModel")
            or name in mapped
        ):
            continue
        config_cls = getattr(obj, "config_class", None)
        if config_cls is None:
            continue
        if _multimodal(config_cls):
            multimodal.append(name)
            continue
        found.append((name not in mapped, name, obj))
    if not found and multimodal:
        raise CodemodError(
            f"out of scope: not a text LM: {source.display} builds its causal LM "
            f"({', '.join(multimodal)}) only over a multimodal config"
        )
    if not found:
        raise CodemodError(
            f"{source.display}: no text causal LM class (…ForCausalLM / …LMHeadModel) found"
        )
    order = list(classes)
    return sorted(found, key=lambda t: (t[0], order.index(t[1])))[0][2]


def _multimodal(config_cls) -> bool:
    """A config that wraps a text config (a vision-language model's) is not a text decoder."""
    try:
        config = config_cls()
        return config.get_text_config() is not config
    except Exception:
        return bool(getattr(config_cls, "sub_configs", None))


def _outermost(lists) -> list:
    """(path, list) pairs not inside another of them: a list inside a layer (StableLM's
    per-head q/k norms, as many as the tiny config's layers) is not the layer list."""
    lists = list(lists)
    return [
        (path, mod)
        for path, mod in lists
        if not any(path.startswith(other + ".") for other, _ in lists)
    ]


def find(source: ModelSource, pymodule, causal_cls, probe: Probe) -> Roles:
    import torch.nn as nn
    from transformers import PreTrainedModel
    from transformers.modeling_layers import GradientCheckpointingLayer

    classes = source.classes
    model, config = probe.model, probe.config
    causal = classes[causal_cls.__name__]
    n_layers = getattr(config, "num_hidden_layers", None)
    lists = _outermost(
        (path, mod)
        for path, mod in model.named_modules()
        if isinstance(mod, nn.ModuleList)
        and len(mod) == n_layers
        and path.count(".") >= 1
    )
    what = f"lists of {n_layers} layers"
    if not lists:
        # fewer layers than the config counts (LongCat-Flash counts its two attention
        # sublayers per layer): the one list of transformers' decoder layers
        what = f"lists of decoder layers and none of {n_layers}"
        lists = _outermost(
            (path, mod)
            for path, mod in model.named_modules()
            if isinstance(mod, nn.ModuleList)
            and len(mod)
            and all(isinstance(x, GradientCheckpointingLayer) for x in mod)
        )
    if len(lists) > 1:
        # a tower beside the decoder (an image encoder's layers, as many as the text
        # model's) does not run on token ids: the decoder's list is the one that ran
        ran = [(p, mod) for p, mod in lists if id(mod[0]) in probe.module_calls]
        lists = ran or lists
    if len(lists) != 1:
        where = f" ({', '.join(p for p, _ in lists)})" if lists else ""
        raise CodemodError(
            f"cannot generate: {causal.name} holds {len(lists)} {what}{where}, expected one"
        )
    layers_path, layer_list = lists[0]
    chain = layers_path.split(".")[:-1]
    layers_attr = layers_path.split(".")[-1]
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
    for inner_attr, wrapper in wrappers:
        if type(wrapper).__name__ not in classes:
            raise CodemodError(
                f"cannot generate: {type(wrapper).__name__} is not defined in {source.display}"
            )
        extra = [
            a
            for a, child in wrapper.named_children()
            if a != inner_attr and any(True for _ in child.parameters())
        ]
        if extra:
            raise CodemodError(
                f"cannot generate: {type(wrapper).__name__} holds {extra[0]} besides its {inner_attr}"
            )
    layer_classes = list(dict.fromkeys(type(x).__name__ for x in layer_list))
    wanted = _reachable(causal.name, classes)
    # classes built indirectly (`CLASSES[config._attn_implementation](config)`): the
    # tiny model says which
    for mod in model.modules():
        name = type(mod).__name__
        if name in classes and name not in wanted:
            _want(wanted, name, classes)
    tables = _class_tables(classes, wanted, pymodule)
    for table in tables.values():  # every class a table holds, built or not
        for name in table.classes.values():
            _want(wanted, name, classes)
    in_layers = {type(x).__name__ for layer in layer_list for x in layer.modules()}
    interface = {
        n
        for n in wanted
        if classes[n].forward is not None and interface_call(classes[n].forward)
    }
    eager = {n: v for n, v in probe.eager.items() if n in in_layers and n in wanted}
    _scope_checks(
        causal.name,
        layer_list,
        interface | set(eager),
        _state_mixers(classes, wanted),
        probe.module_calls,
    )
    method = layers_method(base, layers_attr)
    comp = None if method is not None else _layers_comprehension(base, layers_attr)
    if comp is not None:
        comp = _layer_table_inlined(comp, classes, pymodule)
        for name in m.findall(comp.elt.func, m.Name()):
            if name.value in classes:
                _want(wanted, name.value, classes)

    specs = {
        n: attention_args.infer(classes[n], probe.calls_of(n), config, pymodule)
        for n in wanted
        if n in interface and n in in_layers
    }
    for n, (core, records) in eager.items():
        specs[n] = eager_attention.infer(
            classes[n], core, records, config, pymodule, PROBE_TOKENS
        )

    vocab_attr = _vocab_embedding(base_mod, config, base.forward)
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
    return Roles(
        causal=causal,
        base=base,
        base_attr=chain[0],
        chain=chain,
        wrappers=wrappers,
        layers_attr=layers_attr,
        layer_classes=layer_classes,
        layers_comprehension=comp,
        layers_method=method,
        wanted=wanted,
        in_layers=in_layers,
        attention=specs,
        scopes=_scopes(model, layers_attr, classes, layer_classes),
        vocab_attr=vocab_attr,
        vocab_class=type(_get(base_mod, vocab_attr)).__name__,
        head_attr=head_attr,
        tied_embedding=tied_embedding,
        placement=placement,
        built=_looked_up(probe, classes, wanted),
        tables=tables,
        last_rank_attrs={
            a
            for a, child in model.named_children()
            if a not in (chain[0], head_attr) and any(True for _ in child.parameters())
        },
    )


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


def _want(wanted: list[str], name: str, classes: dict[str, ClassInfo]) -> None:
    """Add `name` and the classes it builds to `wanted` (in place, once each)."""
    wanted += [c for c in _reachable(name, classes) if c not in wanted]


def _state_mixers(classes: dict[str, ClassInfo], wanted: list[str]) -> set[str]:
    """Classes a pattern would map onto a vLLM layer with a state cache (a Mamba-2
    mixer): a mixer, as attention is; its claim proves it or the file is refused."""
    from fusion_patterns.registry import state_patterns

    return {n for n in wanted if state_patterns(classes[n])}


def _scope_checks(
    arch: str,
    layer_list,
    attention_like: set[str],
    state_mixers: set[str],
    calls: dict,
) -> None:
    """Every layer attends, holds a mixer a pattern maps onto vLLM's state cache, or
    mixes nothing across tokens (Nemotron-H's MLP and MoE blocks); a layer mixing
    tokens some other way is out of scope."""
    import torch.nn as nn

    for i, layer in enumerate(layer_list):
        if not any(
            type(x).__name__ in attention_like | state_mixers for x in layer.modules()
        ) and not _token_wise(layer, calls.get(id(layer))):
            from .vllm_native import unmapped

            raise CodemodError(
                unmapped(
                    arch,
                    f"layer {i} ({type(layer).__name__}) has no attention-interface "
                    "call (a mixer vLLM's Transformers backend cannot serve either)",
                )
            )
        mapped = {
            id(c)
            for x in layer.modules()
            if type(x).__name__ in state_mixers
            for c in x.modules()
        }
        convs = [
            type(x).__name__
            for x in layer.modules()
            if isinstance(x, nn.Conv1d) and id(x) not in mapped
        ]
        if convs:
            raise CodemodError(
                f"out of scope: layer {i} holds a convolution ({convs[0]}), a mixer that is not attention"
            )


def _token_wise(layer, call) -> bool:
    """The layer, rerun on what the probe handed it with the first token changed,
    gives every later token the same output: it mixes nothing across tokens."""
    import copy

    import torch

    if call is None:
        return False
    args, kwargs, out = call
    args, kwargs = copy.deepcopy(list(args)), copy.deepcopy(dict(kwargs))
    if args and isinstance(args[0], torch.Tensor):
        x = args[0]
    elif isinstance(kwargs.get("hidden_states"), torch.Tensor):
        x = kwargs["hidden_states"]
    else:
        return False
    if x.dim() != 3 or x.shape[1] < 2 or not isinstance(out, torch.Tensor):
        return False
    changed = x.clone()
    changed[:, 0] += 1.0
    if args and args[0] is x:
        args[0] = changed
    else:
        kwargs["hidden_states"] = changed
    try:
        with torch.no_grad():
            again = layer(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a layer that cannot rerun: not shown token-wise
        return False
    again = again[0] if isinstance(again, (tuple, list)) else again
    if not isinstance(again, torch.Tensor) or again.shape != out.shape:
        return False
    return bool(torch.equal(again[:, 1:], out[:, 1:])) and not torch.equal(
        again[:, :1], out[:, :1]
    )


def layers_method(base: ClassInfo, layers_attr: str) -> cst.FunctionDef | None:
    """The base model's method `self.<layers> = self.<method>()` calls (Zamba 2's
    `get_layers`), built through `assembly/layer_builder.py`."""
    value = base.attrs.get(layers_attr)
    if not m.matches(
        value, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name()), args=[])
    ):
        return None
    name = value.func.attr.value
    for stmt in base.node.body.body:
        if isinstance(stmt, cst.FunctionDef) and stmt.name.value == name:
            return stmt
    return None


def layer_list_name(value: cst.BaseExpression | None) -> str | None:
    """`layers` of `nn.ModuleList(layers)`: decoder layers built into a list first."""
    if not m.matches(value, m.Call(args=[m.Arg(m.Name(), keyword=None)])):
        return None
    return value.args[0].value.value


def appended_layers(base: ClassInfo, value: cst.BaseExpression) -> cst.ListComp | None:
    """`nn.ModuleList(layers)` over `layers = []` and `for i in range(n):
    layers.append(Layer(...))` (Bamba), read as the comprehension it is."""
    name = layer_list_name(value)
    if name is None:
        return None
    for loop in m.findall(base.init, layer_loop(name)):
        *assigns, append = loop.body.body
        call = append.body[0].value.args[0].value
        # `layer_class = TABLE[config.layers_block_type[i]]` before the append (Jamba):
        # put back into the call, so the comprehension is one expression
        values = {a.body[0].targets[0].target.value: a.body[0].value for a in assigns}
        call = call.visit(Substitute(values))
        return cst.ListComp(call, cst.CompFor(target=loop.target, iter=loop.iter))
    return None


def layer_loop(name: str) -> m.For:
    """`for <i> in <...>: <name>.append(<call>)`, after any `<local> = <value>`
    statements the call reads."""
    return m.For(
        body=m.IndentedBlock(
            [
                m.ZeroOrMore(
                    m.SimpleStatementLine(
                        [m.Assign(targets=[m.AssignTarget(m.Name())])]
                    )
                ),
                m.SimpleStatementLine(
                    [
                        m.Expr(
                            m.Call(
                                func=m.Attribute(
                                    value=m.Name(name), attr=m.Name("append")
                                ),
                                args=[m.Arg(m.Call(), keyword=None)],
                            )
                        )
                    ]
                ),
            ]
        ),
        orelse=None,
    )


def _layers_comprehension(base: ClassInfo, layers_attr: str) -> cst.ListComp:
    """`nn.ModuleList([Layer(...) for i in range(n)])`, the shape vLLM's `make_layers`
    takes (a hybrid (Mamba) model says so here, after the scope checks)."""
    value = base.attrs.get(layers_attr)
    comp = m.findall(value, m.ListComp()) if value is not None else []
    if not comp and value is not None:
        comp = [c for c in [appended_layers(base, value)] if c is not None]
    if comp:
        comp[0] = comp[0].with_changes(elt=_one_call(comp[0].elt))
    if not comp or not isinstance(comp[0].elt, cst.Call):
        raise CodemodError(
            f"cannot generate: {base.name}.{layers_attr} is not built as `nn.ModuleList([Layer(...) for i in range(n)])`"
        )
    if not m.matches(comp[0].for_in.iter, m.Call(func=m.Name("range"), args=[m.Arg()])):
        raise CodemodError(
            f"cannot generate: {base.name}.{layers_attr} is not built over range(<layers>)"
        )
    return comp[0]


def _one_call(elt: cst.BaseExpression) -> cst.BaseExpression:
    """`A(args) if <test> else B(args)` (OLMo Hybrid's layer kinds) -> `(A if <test>
    else B)(args)`: one call, whose class the test picks (unchanged otherwise)."""
    if not (
        isinstance(elt, cst.IfExp)
        and isinstance(elt.body, cst.Call)
        and isinstance(elt.orelse, cst.Call)
    ):
        return elt
    args = [
        [code(a.with_changes(comma=cst.MaybeSentinel.DEFAULT)) for a in c.args]
        for c in (elt.body, elt.orelse)
    ]
    if args[0] != args[1]:
        return elt
    func = cst.IfExp(
        test=elt.test,
        body=elt.body.func,
        orelse=elt.orelse.func,
        lpar=[cst.LeftParen()],
        rpar=[cst.RightParen()],
    )
    return elt.body.with_changes(func=func)


def _scopes(model, layers_attr: str, classes, layer_classes) -> dict[str, list[str]]:
    """{class: its paths below a decoder layer}: where the tiny model built it, and
    wherever a branch of a constructor can build it (a real checkpoint's dense layers
    where the tiny config has only MoE ones)."""
    out: dict[str, list[str]] = {}

    def add(cls: str, scope: str) -> None:
        if scope and scope not in out.setdefault(cls, []):
            out[cls].append(scope)

    for path, mod in model.named_modules():
        parts = path.split(".")
        if layers_attr in parts:
            add(type(mod).__name__, ".".join(parts[parts.index(layers_attr) + 2 :]))

    def walk(cls: str, prefix: str, depth: int) -> None:
        info = classes.get(cls)
        if info is None or depth > 3:
            return
        for attr in info.attrs:
            for child in info.constructed_classes(attr):
                if child in classes:
                    add(child, prefix + attr)
                    walk(child, f"{prefix}{attr}.", depth + 1)

    for layer in layer_classes:
        walk(layer, "", 0)
    return {k: v for k, v in out.items() if v}


def _table_of_classes(pymodule, name: str, classes) -> dict[str, str] | None:
    """{key: class name} of a module-level dict of the source's classes, else None."""
    table = getattr(pymodule, name, None)
    if not isinstance(table, dict) or not all(
        isinstance(k, str) and isinstance(v, type) and v.__name__ in classes
        for k, v in table.items()
    ):
        return None
    return {k: v.__name__ for k, v in table.items()}


def _layer_table_inlined(comp: cst.ListComp, classes, pymodule) -> cst.ListComp:
    """`TABLE[config.layers_block_type[i]](config, ...)` over a module-level dict of
    the source's layer classes (Jamba's `ALL_DECODER_LAYER_TYPES`) -> the dict written
    out, so the emitted `make_layers` names each layer class it builds."""
    func = comp.elt.func
    if not m.matches(func, m.Subscript(value=m.Name(), slice=[m.SubscriptElement()])):
        return comp
    table = _table_of_classes(pymodule, func.value.value, classes)
    if not table:
        return comp
    literal = cst.parse_expression(
        "{" + ", ".join(f"{k!r}: {v}" for k, v in table.items()) + "}"
    )
    return comp.with_changes(
        elt=comp.elt.with_changes(func=func.with_changes(value=literal))
    )


def _class_tables(classes, wanted: list[str], pymodule) -> dict:
    """(class, attr) -> the table of the source's classes `__init__` builds it from:
    `MIXER_TYPES[self.block_type](config, ...)` over a module-level dict of classes."""
    out = {}
    for n in wanted:
        for attr, value in classes[n].attrs.items():
            if not m.matches(
                value,
                m.Call(func=m.Subscript(value=m.Name(), slice=[m.SubscriptElement()])),
            ):
                continue
            table = _table_of_classes(pymodule, value.func.value.value, classes)
            if table is None:
                continue
            key = code(value.func.slice[0].slice.value)
            if "_attn_implementation" in key:
                continue  # one class for the model: the eager one (`_looked_up`)
            out[(n, attr)] = ClassTable(key, table)
    return out


def _looked_up(probe: Probe, classes, wanted: list[str]) -> dict[tuple[str, str], str]:
    """(class, attr) -> the source class the tiny model built at an attribute its
    `__init__` does not construct by name."""
    out = {}
    for n in wanted:
        # every instance: a hybrid layer builds its attention on some layers only
        for _, inst in probe.instances.get(n, []):
            for attr, child in inst.named_children():
                if (
                    type(child).__name__ in classes
                    and classes[n].constructed_class(attr) is None
                ):
                    out.setdefault((n, attr), type(child).__name__)
    return out


def _get(module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def _vocab_embedding(base_mod, config, forward=None) -> str:
    """The vocabulary embedding's path below the base model (a direct child, or inside
    an embeddings module): the `nn.Embedding` of `vocab_size` rows, else the one the
    base forward applies to `input_ids` itself (Moshi's, a row longer than the
    vocabulary for its padding token)."""
    import torch.nn as nn

    for attr, child in base_mod.named_modules():
        if (
            isinstance(child, nn.Embedding)
            and child.num_embeddings == config.vocab_size
        ):
            return attr
    on_ids = m.Call(
        func=m.Attribute(value=m.Name("self")), args=[m.Arg(value=m.Name("input_ids"))]
    )
    for call in m.findall(forward, on_ids) if forward is not None else ():
        attr = call.func.attr.value
        child = getattr(base_mod, attr, None)
        if (
            isinstance(child, nn.Embedding)
            and child.num_embeddings >= config.vocab_size
        ):
            return attr
    raise CodemodError(
        f"cannot generate: {type(base_mod).__name__} holds no vocabulary embedding"
    )


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
    sides = _forward_sides(base, layers_attr)
    out = {}
    for i, attr in enumerate(order):
        child = getattr(base_mod, attr, None)
        if child is None or not hasattr(child, "parameters"):
            continue
        read = sides.get(attr, set())
        if not any(True for _ in child.parameters()):
            out[attr] = "every"
        elif len(read) == 1:
            out[attr] = next(iter(read))
        # read on both sides, or not by the forward: by where `__init__` builds it
        elif i < at:
            out[attr] = "first"
        elif i > at:
            out[attr] = "last"
    return out


def _forward_sides(base: ClassInfo, layers_attr: str) -> dict:
    """{attribute: {"first", "last"}}: whether the base forward reads `self.<attr>`
    (itself or in a method of the base it calls) before its layers (the first
    pipeline rank runs it) or after them (the last), whatever order `__init__` builds
    them in (Phi-4-multimodal builds the embedding extension after its layers and runs
    it before them)."""
    if base.forward is None:
        return {}
    layers = m.Attribute(value=m.Name("self"), attr=m.Name(layers_attr))
    body = list(base.forward.body.body)
    at = next((i for i, st in enumerate(body) if m.findall(st, layers)), None)
    if at is None:
        return {}
    methods = {
        f.name.value: f
        for f in base.node.body.body
        if isinstance(f, cst.FunctionDef) and f.name.value != "forward"
    }

    def reads(node, seen: set) -> set[str]:
        out = set()
        for attr in m.findall(node, m.Attribute(value=m.Name("self"))):
            name = attr.attr.value
            if name in methods and name not in seen:
                seen.add(name)
                out |= reads(methods[name], seen)
            out.add(name)
        return out

    out: dict[str, set] = {}
    for i, stmt in enumerate(body):
        side = {"first"} if i < at else {"last"} if i > at else {"first", "last"}
        for name in reads(stmt, set()):
            out.setdefault(name, set()).update(side)
    return out


def head_args(roles: Roles):
    """(hidden size, vocabulary size, bias) of the head's `nn.Linear(...)`."""
    return linear_args(roles.causal.attrs[roles.head_attr])
