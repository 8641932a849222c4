"""Stage 5: every class no pattern claimed whole, copied from its own source with only
what vLLM requires changed (classes.py); the classes a pattern claimed, in the form the
pattern emits; the patterns' rewrites of copied classes applied to their source first.

Tensor parallelism for a copied class is transformers' own plan, kept only where two
simulated ranks compute what the class computes (`fusion_patterns.sharding`); a class
that stays replicated is a report line, never silent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import libcst.matchers as m

from dataclasses import dataclass, field

from fusion_patterns.base import (
    CLASS,
    CONSTRUCTION,
    REWRITE,
    Claim,
    FusionRecord,
    code,
)
from fusion_patterns import sharding

from . import head_rows, merged_linears, packed_qkv, positions
from .classes import CONV1D, LINEARS, Context, prefix_classes
from .classes import rewrite_class
from .config_branches import linear_reads
from .definitions import Definitions

if TYPE_CHECKING:
    from ..claims import Model

__all__ = ["Copied", "Unfused", "copy_classes", "linear_reads"]


@dataclass
class Unfused:
    """A part emitted as the source computes it (no pattern proved a fused form)."""

    source_class: str
    what: str
    reason: str
    # copied, and as fast and as sharded as vLLM's own form (an embedding on
    # VocabParallelEmbedding): reported, but the layout stays native
    kept: bool = False

    def describe(self) -> str:
        kind = "Kept" if self.kept else "Unfused"
        return " ".join(
            f"{kind}: {self.what} ({self.source_class}): {self.reason}".split()
        )


@dataclass
class Copied:
    """Every class's text but the base model's and the causal LM's, and what the
    assembly needs to build those two."""

    pieces: dict[str, str]
    context: Context
    unfused: list[Unfused] = field(default_factory=list)
    # linears the copy builds as a fused vLLM layer (a packed q/k/v: QKVParallelLinear)
    records: list[FusionRecord] = field(default_factory=list)


@dataclass
class TensorParallel:
    """How the copied classes shard (`_tp_styles`)."""

    styles: dict[str, dict[str, str]]  # class -> {linear: style}
    notes: list[Unfused]
    no_plan: dict[str, str]  # class -> why its dataflow gives no plan
    # class -> its attributes counting a sharded width, divided over the ranks
    divided: dict[str, list[str]] = field(default_factory=dict)
    # class -> the config branches its sharding is proven on, as `__init__` tests them
    conditions: dict[str, str] = field(default_factory=dict)
    # class -> {linear: its out_features expressions that build the [q; k; v] proven}
    qkv_outputs: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    records: list[FusionRecord] = field(default_factory=list)


def _claimed_attrs(model: Model, cls: str) -> set[str]:
    """The attributes of `cls` a claim has taken (its merged projections), or all of
    them where a claim emits the class whole."""
    if model.claimed_whole(cls):
        return set(model.classes[cls].attrs)
    return {
        a
        for c in model.claims
        if c.class_name == cls
        for r in c.records
        for a in r.sources
    }


def _claims(model: Model, cls: str, *kinds: str) -> list[Claim]:
    return [c for c in model.claims if c.class_name == cls and c.kind in kinds]


def copy_classes(model: Model, defs: Definitions, mask_functions: set[str]) -> Copied:
    roles, classes = model.roles, model.classes
    tp = _tp_styles(model)
    styles, tp_notes, no_plan = tp.styles, tp.notes, tp.no_plan
    merges = merged_linears.plan(model, styles, lambda n: _claimed_attrs(model, n))
    whole = {c.class_name: c for c in model.claims if c.kind == CLASS}
    constructions = {c.class_name: c for c in model.claims if c.kind == CONSTRUCTION}
    emitted = [
        n
        for n in roles.wanted
        if n not in constructions and not _is_pretrained_helper(n, model)
    ]
    rebased = {roles.vocab_class} if roles.vocab_class in classes else set()
    # constructions that become a vLLM layer keyed by its path (a Mamba-2 mixer): their
    # builders take `prefix`
    keyed = {n for n, c in constructions.items() if c.pattern.keyed_by_prefix}
    linear_classes = _linear_classes(model)
    ctx = Context(
        classes=classes,
        constructions=constructions,
        prefix_classes=prefix_classes(
            classes,
            set(emitted) | keyed | linear_classes,
            set(whole) | keyed | linear_classes,
            roles.attention,
            roles.built,
        )
        | rebased,
        attention={n: s for n, s in roles.attention.items() if n not in whole},
        styles=styles,
        divided=tp.divided,
        tp_conditions=tp.conditions,
        qkv_outputs=tp.qkv_outputs,
        merges={g.cls: g for g in merges},
        kept_linears=model.kept_linears,
        branch_reads=model.branch_reads,
        sharded_attention={
            n
            for n in roles.attention
            if any(sharding.is_column(s) for s in styles.get(n, {}).values())
        },
        mask_functions=mask_functions,
        built=roles.built,
        tables=roles.tables,
        attention_name="VllmAttention" if "Attention" in classes else "Attention",
        merged_heads={c.class_name: c.heads for c in model.claims if c.heads},
        call_sites={
            c.class_name: c
            for c in model.claims
            if c.kind == CLASS or c.pattern.rewrites_calls
        },
        positions=_need_positions(model),
        linear_classes=linear_classes,
    )
    pieces: dict[str, str] = {}
    unfused: list[Unfused] = []
    skip = {roles.causal.name, roles.base.name} | roles.wrapper_names
    for n in emitted:
        if n in skip:
            continue
        info = classes[n]
        if n in whole:
            pieces[n] = whole[n].pattern.emit_class(whole[n], info)
            if line := _emitted_whole(n, pieces[n], whole[n].pattern):
                unfused.append(line)
            continue
        rebase = "VocabParallelEmbedding" if n in rebased else None
        rewrites = tuple(_claims(model, n, REWRITE))
        pieces[n] = rewrite_class(info, ctx, base=rebase, claims=rewrites)
        positions.refuse_if_still_used(info, pieces[n])
        line = _unfused_line(model, n, rewrites)
        if rebase and line is not None and not model.refused(n):
            line = Unfused(
                n,
                "embedding",
                "copied from the source onto VocabParallelEmbedding (sharded over the "
                "vocabulary as vLLM's own)",
                kept=True,
            )
        if line is not None:
            unfused.append(line)
        if n in model.branch_reads:
            unfused.append(
                Unfused(n, "config branch", model.branch_reads[n].describe())
            )
    for n in roles.attention:
        if n in pieces and (rows := head_rows.per_head_parameters(model, n)):
            pieces[n] = head_rows.shard_in_init(pieces[n], n, rows)
    return Copied(
        pieces=pieces,
        context=ctx,
        records=tp.records
        + [
            r
            for g in merges
            if g.cls in pieces
            for r in merged_linears.records(g, model.roles.scopes.get(g.cls, [""]))
        ],
        unfused=unfused
        + tp_notes
        + _replicated(
            {n: t for n, t in pieces.items() if n not in whole},
            tp_notes,
            model,
            no_plan,
            styles,
        ),
    )


def _replicated(
    pieces: dict[str, str],
    noted: list[Unfused],
    model,
    no_plan: dict[str, str],
    styles: dict[str, dict[str, str]],
) -> list[Unfused]:
    """A copied class whose linears every rank holds whole is a slow path under TP, and
    is said so, unless `_tp_styles` already gave the reason its plan was not taken (a
    class a pattern emitted whole is sharded as vLLM's own file shards it).
    """
    import re

    # a class pinned to its proven branches still says which linears stay whole
    said = {u.source_class for u in noted if not u.reason.startswith("sharded where")}
    out = []
    for n, text in pieces.items():
        if n not in said and (stacks := _stacked_parameters(model, n)):
            # copied experts (Llama 4's bmm over every expert): no linear to shard
            out.append(
                Unfused(
                    n,
                    "tensor parallel",
                    f"replicated on every rank: {', '.join(stacks)} (stacked "
                    "parameters of a copied class, not vLLM layers: every rank holds "
                    "them whole)",
                )
            )
        attrs = re.findall(
            r"self\.(\w+) = (?:conv1d_layout\()?ReplicatedLinear\(", text
        )
        if attrs and n not in said:
            if model.tp_plan.get(n):
                why = "transformers' TP plan leaves them whole"
            elif n in no_plan or model.first(n) is None:
                why = (
                    "transformers' TP plan has no entry for them, and their dataflow "
                    f"gives none: {no_plan.get(n, 'the tiny model never builds it')}"
                )
            elif set(attrs) & set(styles.get(n, {})):
                why = (
                    "built so in a branch the tiny model does not take (the proven "
                    "construction of the same layer is sharded)"
                )
            else:
                why = (
                    "the plan their dataflow gives leaves them whole: the tiny model "
                    "does not call them, or they are not between two linears of the class"
                )
            out.append(
                Unfused(
                    n,
                    "tensor parallel",
                    f"replicated on every rank: {', '.join(dict.fromkeys(attrs))} ({why})",
                )
            )
    return out


def _emitted_whole(n: str, text: str, pattern) -> Unfused | None:
    """A pattern's class that holds linears whole on every rank (`ReplicatedLinear`,
    `disable_tp=True`) says so: kept where the pattern gives vLLM's own file's reason
    for the same layout, unfused (a slow path under TP) where it gives none."""
    import ast

    attrs = []
    for node in ast.walk(ast.parse(text)):
        if not (
            isinstance(node, ast.Assign)
            and isinstance(call := node.value, ast.Call)
            and isinstance(target := node.targets[0], ast.Attribute)
        ):
            continue
        if ast.unparse(call.func) == "ReplicatedLinear" or any(
            k.arg == "disable_tp"
            and isinstance(k.value, ast.Constant)
            and k.value.value is True
            for k in call.keywords
        ):
            attrs.append(target.attr)
    if not attrs:
        return None
    names = ", ".join(dict.fromkeys(attrs))
    if pattern.whole_on_ranks:
        return Unfused(
            n,
            "tensor parallel",
            f"{names} whole on every rank: {pattern.whole_on_ranks}",
            kept=True,
        )
    return Unfused(
        n,
        "tensor parallel",
        f"replicated on every rank: {names} (as the pattern emits them)",
    )


def _stacked_parameters(model, cls: str) -> list[str]:
    """The class's own parameters of three or more dims (a stack of experts' weights)
    in the tiny model."""
    inst = model.first(cls)
    if inst is None:
        return []
    return [n for n, p in inst.named_parameters(recurse=False) if p.dim() >= 3]


def _own(attrs: list[str], text: str) -> list[str]:
    """The attributes only their own class reads: one another module reads
    (`self.self_attn.embed_dim`) would see this rank's width where the proof of that
    module never looked, so dividing it is not proven."""
    import re

    return [
        a for a in attrs if not re.search(rf"\b(?!self\b|config\b)\w+\.{a}\b", text)
    ]


def _linear_classes(model: Model) -> set[str]:
    """The model's classes a claim proved to compute what `nn.Linear` does."""
    return {
        c.class_name
        for c in model.claims
        if c.kind == CONSTRUCTION and c.pattern.builds_linear
    }


def _not_vllm_linears(model: Model, cls: str, plan: dict[str, str]) -> str:
    """The sharded layers of `plan` that the copy does not build as vLLM linears (a
    subclass of nn.Linear with its own forward, a linear read as weights), as text."""
    info = model.classes[cls]
    built = {a: info.constructed_classes(a) for a in plan if plan[a] != "replicate"}
    linears = {*LINEARS, CONV1D, *_linear_classes(model)}
    return ", ".join(
        f"self.{a} ({', '.join(b) or 'no construction'})"
        for a, b in built.items()
        if not b or not set(b) <= linears or a in model.kept_linears
    )


def _tp_styles(model: Model) -> TensorParallel:
    """{class: {linear: style}}: the claims' own, and for every other copied class with
    linears transformers' plan (or, where it has no entry, the plan its dataflow gives)
    where sharding the class over two simulated ranks is proven; a class that fails
    stays replicated, with a report line."""
    fixed = {c.class_name: c.styles for c in model.claims if c.styles}
    styles: dict[str, dict[str, str]] = dict(fixed)
    notes: list[Unfused] = []
    no_plan: dict[str, str] = {}
    out = TensorParallel(styles, notes, no_plan)
    for claim in model.claims:  # a claim sharded on some of its config's ways only
        if claim.styles and claim.sharded is not None:
            if claim.sharded.where:
                out.conditions[claim.class_name] = claim.sharded.where
            if claim.sharded.note:
                notes.append(
                    Unfused(claim.class_name, "tensor parallel", claim.sharded.note)
                )
    skip = {model.roles.causal.name, model.roles.base.name}
    for n in model.roles.wanted:
        if n in fixed or n in skip or model.claimed_whole(n):
            continue
        kinds = _instance_kinds(model, n)
        if not kinds:
            continue
        inst, call = kinds[0]
        plan = model.tp_plan.get(n)
        if not plan:
            plan = sharding.derive(inst, call, model.kept_linears)
            if isinstance(plan, str):
                no_plan[n] = plan  # its linears, if any, are reported replicated
                continue
        if stays := _not_vllm_linears(model, n, plan):
            notes.append(
                Unfused(
                    n,
                    "tensor parallel",
                    f"replicated: {stays} the file keeps as the source builds it, "
                    "not a vLLM linear it can shard",
                )
            )
            continue
        spec = model.roles.attention.get(n)
        kv = spec.kv_head_attrs if spec else []
        sinks = spec.sinks if spec else None
        why = None

        def proven(option, counted):  # on every kind of instance the model builds
            for kind, kind_call in kinds:
                if failed := sharding.prove(
                    kind, option, counted, kind_call, sinks, kv_attrs=kv
                ):
                    return failed
            return None

        def proven_on(other, option, counted):  # a config the tiny one is not
            return sharding.prove(
                other.instance, option, counted, other.call, sinks, kv_attrs=kv
            )

        held = _held_kv_attrs(spec, inst)
        countings = [spec.head_attrs if spec else []]
        if held:  # the kv heads the weights hold, before a broadcast: theirs too
            countings.append(countings[0] + held)
        for heads in countings:
            for option in sharding.candidates(inst, plan, heads, kv):
                failed = proven(option, heads)
                wide = sorted(
                    set().union(
                        *(sharding.widths(k, option, heads, kv) for k, _ in kinds)
                    )
                )
                wide = _own(wide, model.source.text)
                if failed is not None and wide:
                    # the class counts a sharded width whole: this rank's share, if proven
                    if proven(option, heads + wide) is None:
                        failed, out.divided[n] = None, wide
                if failed is None:
                    why, plan = None, option
                    break
                why = why or failed
            if why is None:
                break
        if why is None:  # and on every other way its config branches can go
            counted = heads + out.divided.get(n, [])
            pin = model.sharded_ways(
                n, kinds[0], plan, lambda o: proven_on(o, plan, counted)
            )
            if pin.where is None:
                why = pin.note.removeprefix("replicated: ")
            elif sharding.QKV in plan.values():  # its record says where it is whole
                why = _packed_qkv(out, model, n, inst, plan, spec, pin.where)
            else:
                if pin.where:
                    notes.append(Unfused(n, "tensor parallel", pin.note))
                if held and heads != countings[0]:  # the kv heads the weights hold
                    out.divided[n] = [*out.divided.get(n, []), *held]
            if why is None and pin.where:
                out.conditions[n] = pin.where
        elif not held and sharding.QKV not in plan.values():
            # the tiny config's way fails: sharded where another way is proven
            for option in sharding.candidates(inst, plan, countings[0], kv):
                pin = model.sharded_ways(
                    n,
                    kinds[0],
                    option,
                    lambda o, option=option: proven_on(o, option, countings[0]),
                    tiny_failure=why,
                )
                if pin.where:
                    plan, why = option, None
                    out.conditions[n] = pin.where
                    notes.append(Unfused(n, "tensor parallel", pin.note))
                    break
        if why is not None and not held and len(kinds) > 1:
            # some kinds of layer shard and others do not: sharded on those that do
            found = _sharded_on_kinds(
                model,
                n,
                kinds,
                plan,
                lambda k, c: sharding.prove(
                    k, plan, countings[0], c, sinks, kv_attrs=kv
                ),
            )
            if found is not None:
                out.conditions[n], note = found
                notes.append(Unfused(n, "tensor parallel", note))
                why = None
        if why is None:
            styles[n] = plan
        else:
            notes.append(Unfused(n, "tensor parallel", f"replicated: {why}"))
    return out


def _sharded_on_kinds(model: Model, n: str, kinds, plan, prove):
    """(the test, as `__init__` can read it, that takes the kinds of `n`'s instances
    `plan` is proven on, a report line) where it fails on others that differ from them
    in a value `__init__` keeps from its own arguments (Gemma 3n's MLP: sharded where
    `config.activation_sparsity_pattern[layer_idx] == 0.0`, whole on every rank on its
    sparse layers); or None. Values the tiny model never built are whole too."""
    results = [(k, c, prove(k, c)) for k, c in kinds]
    good = [(k, c) for k, c, why in results if why is None]
    bad = [(k, why) for k, _, why in results if why is not None]
    structures = {_structure(k) for k, _, _ in results}
    if not good or not bad or len(structures) != 1:
        return None
    info = model.classes[n]
    for attr, _ in _kept_values(good[0][0]):
        proven = {getattr(k, attr) for k, _ in good}
        failing = {getattr(k, attr, None) for k, _ in bad}
        expr = _kept_from_arguments(info, attr)
        if proven & failing or expr is None:
            continue
        if len(proven) == 1:
            taken = f"{expr} == {next(iter(proven))!r}"
        else:
            taken = f"{expr} in ({', '.join(map(repr, sorted(proven)))})"
        # and on every way its config branches go, on the kinds proven
        if any(
            model.sharded_ways(n, kind, plan, lambda o: prove(o.instance, o.call)).where
            != ""
            for kind in good
        ):
            return None
        kind, why = bad[0]
        said = f"self.{attr}={getattr(kind, attr)!r}"
        return taken, (
            f"sharded where `{taken}` (proven on those layers), whole on every rank "
            f"elsewhere (with {said} {why.removeprefix('sharded ')})"
        )
    return None


def _structure(inst) -> tuple:
    return tuple((name, type(c).__name__) for name, c in inst.named_children())


def _kept_from_arguments(info, attr: str) -> str | None:
    """The expression `__init__` assigns `self.<attr>` once, where it reads only the
    method's own arguments (`config.activation_sparsity_pattern[layer_idx]`): what a
    test at the linears' construction can read in its place; else None."""
    if info.init is None:
        return None
    found = m.findall(
        info.init,
        m.Assign(targets=[m.AssignTarget(m.Attribute(m.Name("self"), m.Name(attr)))]),
    )
    if len(found) != 1:
        return None
    value = found[0].value
    params = {p.name.value for p in info.init.params.params}
    attrs = {id(a.attr) for a in m.findall(value, m.Attribute())}
    roots = {x.value for x in m.findall(value, m.Name()) if id(x) not in attrs}
    if not roots <= params | {"True", "False", "None"} or "self" in roots:
        return None
    return code(value)


def _held_kv_attrs(spec, inst) -> list[str]:
    """The attributes counting the kv heads the weights hold where keys and values are
    broadcast to more heads before attention (Falcon's `num_kv_heads`, grouped)."""
    if spec is None or spec.broadcast is None:
        return []
    held = spec.broadcast[0]
    return [
        a
        for a, v in vars(inst).items()
        if type(v) is int
        and v == held
        and "head" in a
        and not any(w in a for w in ("dim", "size"))
        and a not in spec.head_attrs
    ]


def _packed_qkv(out: TensorParallel, model: Model, n: str, inst, plan, spec, taken):
    """Record the [q; k; v] linear of `n` proven sharded as QKVParallelLinear: the
    construction that builds it and the config branches it is pinned to (`taken`:
    whole on every rank elsewhere, said in its record); or why not."""
    attrs = [a for a, s in plan.items() if s == sharding.QKV]
    outputs = {a: packed_qkv.built_outputs(model.classes[n], a, inst) for a in attrs}
    if not all(outputs.values()):
        return "the construction of its [q; k; v] linear is not read from the source"
    out.qkv_outputs[n] = outputs
    out.records += [packed_qkv.record(n, a, inst, spec, taken) for a in attrs]
    return None


def _instance_kinds(model: Model, cls: str) -> list[tuple[object, object]]:
    """(instance, its call) for one instance of each structure the tiny model built of
    `cls` (Gemma 4's kv-shared layers build no k/v projections) and each set of plain
    values its `__init__` kept (Gemma 3n's per-layer activation sparsity, which its
    forward branches on), first one first; a transformers `Conv1D` child seen as the
    linear the file builds."""
    kinds: dict[tuple, tuple[object, object]] = {}
    for _, inst in model.probe.instances.get(cls, []):
        shape = _kept_values(inst) + tuple(
            (
                (
                    name,
                    type(child).__name__,
                    tuple(getattr(child, "weight", ()).shape or ()),
                )
                if hasattr(getattr(child, "weight", None), "shape")
                else (name, type(child).__name__)
            )
            for name, child in inst.named_children()
        )
        if shape not in kinds:
            kinds[shape] = (sharding.as_linears(inst), model.call(inst))
    return list(kinds.values())


def _kept_values(inst) -> tuple:
    """The plain values (numbers, flags, strings) an instance keeps, but its position
    in the stack (`layer_idx`), which only names a cache slot."""
    return tuple(
        (k, v)
        for k, v in sorted(vars(inst).items())
        if type(v) in (bool, int, float, str)
        and not k.startswith("_")
        and not any(w in k for w in ("idx", "index", "layer_id", "layer_number"))
    )


def _need_positions(model: Model) -> set[str]:
    """Claimed modules needing vLLM's positions, and the copied classes that hand
    them down, directly or through others (the decoder layer, a wrapper block)."""
    roles, classes = model.roles, model.classes
    need = {c.class_name for c in model.claims if c.needs_positions}
    if not need:
        return set()
    out: set[str] = set()
    changed = True
    while changed:
        changed = False
        for n in roles.wanted:
            if n in out or n in need or n in (roles.causal.name, roles.base.name):
                continue
            info = classes[n]
            children = (
                {info.constructed_class(a) for a in info.attrs}
                | {info.list_element_class(a, classes) for a in info.attrs}
                | {v for (owner, _), v in roles.built.items() if owner == n}
            )
            if children & (need | out):
                out.add(n)
                changed = True
    # the claimed classes too: a caller hands them `positions=positions` unless the
    # claim's own call site does (the rope's), and their forward takes them
    return out | need


def _is_pretrained_helper(name: str, model: Model) -> bool:
    """PreTrainedModel subclasses other than the base model, the causal LM and the
    wrappers between them (the `XPreTrainedModel` weight-init base) are not emitted."""
    from transformers import PreTrainedModel

    roles = model.roles
    if name in (roles.causal.name, roles.base.name) or name in roles.wrapper_names:
        return False
    obj = getattr(model.pymodule, name, None)
    return isinstance(obj, type) and issubclass(obj, PreTrainedModel)


def _unfused_line(model: Model, n: str, rewrites: tuple[Claim, ...]) -> Unfused | None:
    roles = model.roles
    if n in roles.attention:
        return Unfused(
            n,
            "attention",
            "kept as the source computes it; " + roles.attention[n].describe(),
        )
    if n in roles.layer_classes:
        if rewrites:
            return None  # its forward is a proven pattern's rewrite
        return Unfused(
            n,
            "decoder layer",
            "its forward as the source writes it (residual adds, norms, sublayer calls)",
        )
    refused = [r for r in model.refusals if r.source_class == n]
    why = refused[0].reason if refused else None
    return Unfused(n, "module", "copied from the source" + (f" ({why})" if why else ""))
