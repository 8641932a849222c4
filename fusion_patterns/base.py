"""What every fusion pattern shares: the interface the pipeline calls, the claim it
makes, the record it produces and the refusal it can give.

A pattern is one class on `Pattern` (as vLLM's Transformers-backend fusers are one
class each on a shared base): it claims the parts of a model it proves (a whole class,
the constructions of a class, or a rewrite of a copied class), says why it refused the
candidates it did not prove, and emits what it claimed. The records are data, not
exceptions: every table of the generated file (the rewrite, `packed_modules_mapping`,
the stacked weight mapping, the report) is derived from the same records.
`registry.PATTERNS` lists the patterns in the order the claims stage runs them; no
stage outside this package names one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import libcst as cst
import libcst.matchers as m

ShardId = str | int


@dataclass(frozen=True)
class FusionRecord:
    """One fusion that fired on one module class."""

    pattern: str
    source_class: str
    sources: tuple[str, ...]
    target: str
    vllm_class: str
    # Shard ids in merged order; empty for fusions that stack no weights (norms).
    shard_ids: tuple[ShardId, ...] = ()
    # Attribute path of the module inside a decoder layer ("self_attn", "mlp"), used to
    # scope the stacked-weight keys so they never catch a same-named projection elsewhere.
    scope: str = ""
    # the checkpoint holds the merged tensor already (Phi-3's qkv_proj): nothing to
    # stack, the merged layer's weight loader splits it into its shards. The text says
    # how it is packed.
    packed: str = ""
    # what the fused layer does beyond its name (a MoE block's routing)
    detail: str = ""

    def describe(self) -> str:
        # a module below another sublayer (a MoE block's shared experts) says where
        where = f"in self.{self.scope}" if "." in self.scope else ""
        packed = "".join(f", {t}" for t in (self.packed, self.detail, where) if t)
        return (
            f"Fused: {' + '.join(self.sources)} ({self.source_class}) -> "
            f"{self.target} ({self.vllm_class}{packed})"
        )

    @property
    def stacks_weights(self) -> bool:
        return bool(self.shard_ids)


@dataclass(frozen=True)
class Refusal:
    """A candidate that looked like a pattern but was not proven; it stays unfused."""

    pattern: str
    source_class: str
    what: str
    reason: str

    def describe(self) -> str:
        # one line, whatever source text the reason quotes
        return " ".join(
            f"Refused: {self.what} ({self.source_class}): {self.reason}".split()
        )


def refused_by(exc: Exception, pattern: str, cls: str, what: str) -> "Refusal":
    """A candidate whose proof raised: refused with the proof's reason, or with why the
    proof could not run (never a traceback)."""
    if isinstance(exc, PatternRefused):
        return Refusal(pattern, cls, what, str(exc))
    text = str(exc).splitlines()[0] if str(exc) else ""
    return Refusal(
        pattern, cls, what, f"proof failed to run: {type(exc).__name__}: {text}"
    )


@dataclass(frozen=True)
class ClassTable:
    """`TABLE[<key>](...)`: the source's class built for each value of `key` (its
    code, `self.block_type`), from a module-level dict of classes."""

    key: str
    classes: dict[str, str]

    def class_at(self, branch: tuple[str, str] | None) -> str | None:
        """The class a call inside `if <key> == "<value>":` reaches."""
        if branch is None or branch[0] != self.key:
            return None
        return self.classes.get(branch[1])


_KEYED_BRANCH = m.If(
    test=m.Comparison(
        comparisons=[
            m.ComparisonTarget(operator=m.Equal(), comparator=m.SimpleString())
        ]
    )
)


def branch_keys(node: cst.CSTNode) -> dict[int, tuple[str, str]]:
    """id of each call inside `if <expr> == "<value>":` -> (its expr's code, value);
    the innermost such branch wins."""
    out = {}
    for branch in m.findall(node, _KEYED_BRANCH):  # outer branches first
        test = branch.test
        key = (code(test.left), test.comparisons[0].comparator.evaluated_value)
        for call in m.findall(branch.body, m.Call()):
            out[id(call)] = key
    return out


class PatternRefused(Exception):
    """Raised inside a pattern's extraction when a candidate fails one of its checks.

    Caught by the pattern itself and turned into a `Refusal` record; it never leaves
    the pattern module."""


@dataclass
class ClassInfo:
    """The parts of one transformers module class the patterns look at."""

    node: cst.ClassDef
    name: str
    bases: tuple[str, ...]
    init: cst.FunctionDef | None
    forward: cst.FunctionDef | None
    # `self.<attr> = <expr>` statements of `__init__`, in source order.
    attrs: dict[str, cst.BaseExpression] = field(default_factory=dict)
    # every expression assigned to each attribute, branches included (a decoder layer
    # that builds a MoE block on some layers and a dense MLP on the others)
    choices: dict[str, list[cst.BaseExpression]] = field(default_factory=dict)

    def init_statements(self) -> list[cst.BaseStatement]:
        return list(self.init.body.body) if self.init else []

    def constructed_class(self, attr: str) -> str | None:
        """Name of the class `self.<attr>` is built from (`nn.Linear` -> "nn.Linear")."""
        value = self.attrs.get(attr)
        if isinstance(value, cst.Call):
            return dotted_name(value.func)
        return None

    def list_element_class(self, attr: str, classes) -> str | None:
        """The one class of `classes` an `nn.ModuleList([...])` attribute is built of
        (`self.<attr>[i]`), or None (not a module list, or several classes)."""
        value = self.attrs.get(attr)
        if not isinstance(value, cst.Call) or dotted_name(value.func) not in (
            "nn.ModuleList",
            "torch.nn.ModuleList",
        ):
            return None
        held = {
            dotted_name(c.func) for a in value.args for c in m.findall(a, m.Call())
        } & set(classes)
        return next(iter(held)) if len(held) == 1 else None

    def constructions(self, attr: str) -> list[cst.Call]:
        """Every call `self.<attr>` may be built by, in source order (both sides of
        `A(...) if <test> else B(...)` too)."""
        calls = []
        pending = list(self.choices.get(attr, []))
        while pending:
            value = pending.pop(0)
            if isinstance(value, cst.IfExp):
                pending[:0] = [value.body, value.orelse]
            elif isinstance(value, cst.Call):
                calls.append(value)
        return calls

    def constructed_classes(self, attr: str) -> list[str]:
        """Every class `self.<attr>` may be built from, in source order."""
        names = (dotted_name(c.func) for c in self.constructions(attr))
        return list(dict.fromkeys(filter(None, names)))


def dotted_name(node: cst.BaseExpression) -> str | None:
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        inner = dotted_name(node.value)
        return f"{inner}.{node.attr.value}" if inner else None
    return None


def code(node: cst.CSTNode) -> str:
    """Source text of one expression node, as written in the modeling file."""
    return cst.Module(body=[]).code_for_node(node)


def self_attr(name: str | m.BaseMatcherNode = m.DoNotCare()) -> m.Attribute:
    """Matcher for `self.<name>`."""
    return m.Attribute(
        value=m.Name("self"), attr=m.Name(name) if isinstance(name, str) else name
    )


def self_call(name, arg) -> m.Call:
    """Matcher for `self.<name>(<arg>)` with exactly one positional argument."""
    return m.Call(func=self_attr(name), args=[m.Arg(value=arg, keyword=None)])


def chunk_call(parts: int) -> m.Call:
    """Matcher for `<name>.chunk(<parts>, dim=-1)`: a packed projection split in parts."""
    return m.Call(
        func=m.Attribute(value=m.Name(), attr=m.Name("chunk")),
        args=[
            m.Arg(m.Integer(str(parts))),
            m.Arg(
                m.UnaryOperation(operator=m.Minus(), expression=m.Integer("1")),
                keyword=m.Name("dim"),
            ),
        ],
    )


def linear_args(
    call: cst.Call,
) -> tuple[cst.BaseExpression, cst.BaseExpression, cst.BaseExpression]:
    """(in_features, out_features, bias) of an `nn.Linear(...)` call; bias defaults to True."""
    positional = [a.value for a in call.args if a.keyword is None]
    keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    names = ["in_features", "out_features", "bias"]
    values = dict(zip(names, positional))
    values.update({k: v for k, v in keywords.items() if k in names})
    if "in_features" not in values or "out_features" not in values:
        raise PatternRefused("nn.Linear without in/out features")
    return (
        values["in_features"],
        values["out_features"],
        values.get("bias", cst.Name("True")),
    )


def with_positions_param(forward: cst.FunctionDef) -> cst.FunctionDef:
    """`forward` taking vLLM's `positions` (a keyword defaulting to None), unless it
    does already."""
    params = forward.params
    if "positions" in {p.name.value for p in m.findall(params, m.Param())}:
        return forward
    param = cst.Param(
        cst.Name("positions"),
        annotation=cst.Annotation(cst.parse_expression("torch.Tensor | None")),
        default=cst.Name("None"),
    )
    if isinstance(params.star_arg, cst.Param) or params.kwonly_params:
        params = params.with_changes(kwonly_params=[*params.kwonly_params, param])
    else:
        params = params.with_changes(params=[*params.params, param])
    return forward.with_changes(params=params)


def takes_one_argument(forward: cst.FunctionDef | None) -> bool:
    """`forward(self, x)`: one positional argument, nothing else."""
    if forward is None:
        return False
    params = forward.params
    return (
        len(params.params) == 2
        and params.star_arg is cst.MaybeSentinel.DEFAULT
        and not params.kwonly_params
        and params.star_kwarg is None
    )


def proven_classes(model, pattern: str, what: str, candidate, prove, skip=()):
    """(class, what `prove(model, info, instance)` returned: a spec or a Refusal) for
    each class of the model `candidate(info, instance)` accepts and no pattern claimed
    whole; a proof that raises is a Refusal, one returning None is no candidate."""
    for n in model.roles.wanted:
        info = model.classes[n]
        if model.claimed_whole(n) or n in skip:
            continue
        instance = model.first(n)
        if not candidate(info, instance):
            continue
        try:
            result = prove(model, info, instance)
        except Exception as exc:  # noqa: BLE001 - a proof that cannot run: copied
            result = Refusal(pattern, n, what, f"the proof cannot run ({exc})")
        if result is not None:
            yield n, result


def construction_records(
    model, cls: str, pattern: str, vllm_class: str, detail: str
) -> list[FusionRecord]:
    """One record per `self.<attr> = <cls>(...)` in the classes the model copies."""
    return [
        FusionRecord(
            pattern=pattern,
            source_class=owner.name,
            sources=(cls,),
            target=attr,
            vllm_class=vllm_class,
            detail=detail,
        )
        for owner in (model.classes[o] for o in model.roles.wanted)
        for attr in owner.attrs
        for call in owner.constructions(attr)
        if dotted_name(call.func) == cls
    ]


# how a modeling file names torch's linear layer
LINEARS = ("nn.Linear", "torch.nn.Linear")


def is_linear(info: ClassInfo, attr: str) -> bool:
    return info.constructed_class(attr) in (*LINEARS, "Linear")


# --- the interface ------------------------------------------------------------------

CLASS = "class"  # the pattern emits the class in place of its copy
CONSTRUCTION = "construction"  # not emitted; every `Cls(...)` becomes the pattern's
REWRITE = "rewrite"  # the class is copied, and the pattern rewrites part of the copy


@dataclass
class Claim:
    """One part of the model a pattern proved, and how the generated file holds it."""

    pattern: "Pattern"
    class_name: str
    spec: Any
    kind: str = REWRITE
    records: list[FusionRecord] = field(default_factory=list)
    # the claimed module is called with vLLM's `positions` (its own rope): every copied
    # module between the decoder layer and it hands them down
    needs_positions: bool = False
    # the linears of the claimed class and their TP styles, where the claim fixes them
    styles: dict[str, str] | None = None
    # expressions of this rank's (query, kv) head counts once the claim has merged the
    # projections (the copied attention's reshapes count them)
    heads: tuple[str, str] | None = None
    # where `styles` shard the class over its config's ways (`claims.ShardedWays`),
    # where the claim says so: whole on every rank elsewhere, with a report line
    sharded: Any = None
    # the copied decoder layer now returns (hidden states, residual): the base model's
    # loop carries the residual and its final norm adds it
    carries_residual: bool = False
    # experts fused into vLLM's MoE layer: their (gate_up, down) parameter names, onto
    # which the loader renames the checkpoint's per-expert tensors
    experts: tuple[str, str] | None = None


class Pattern:
    """A fusion: `claim` proves parts of one model; the hooks emit what it claimed.

    `claim(model)` gets the model as the stages before it found it (classes, the tiny
    instance and what each module was called with, the roles, the claims of the
    patterns before it) and yields `Claim`s and `Refusal`s. The hooks the copy and
    assembly stages call take only the claim and plain source nodes."""

    name = ""
    # its `call_site` rewrites how copied callers call a class it rewrites (a claim of
    # kind CLASS is always called the pattern's way)
    rewrites_calls = False
    # why the linears a CLASS claim builds whole on every rank are as vLLM's own file
    # holds them (empty: such a linear is reported as a slow path under TP)
    whole_on_ranks = ""
    # its CONSTRUCTION is a vLLM layer keyed by its module path: builders take `prefix`
    keyed_by_prefix = False
    # its CONSTRUCTION computes what `nn.Linear` with the same arguments computes: the
    # copy builds it as it builds `nn.Linear` (a vLLM linear, sharded where proven)
    builds_linear = False
    # (dtype, why): vLLM's CPU build runs what it emits in this dtype only
    cpu_dtype: tuple[str, str] | None = None

    def claim(self, model) -> Iterable[Claim | Refusal]:
        raise NotImplementedError

    # kind == CLASS: the class's text
    def emit_class(self, claim: Claim, info: ClassInfo) -> str:
        raise NotImplementedError

    # kind == CONSTRUCTION: the expression built instead of `call`, which builds
    # `self.<path>` (None: outside a `self.<attr> = ...` statement)
    def construction(self, claim: Claim, call: cst.Call, path: str | None) -> str:
        raise NotImplementedError

    # kind == REWRITE: the copied class, rewritten (after the copy's own changes)
    def rewrite_class(self, claim: Claim, node: cst.ClassDef) -> cst.ClassDef:
        return node

    def call_site(self, claim: Claim, call: cst.Call) -> cst.BaseExpression | None:
        """How a copied caller calls the claimed module (None: as the source does). A
        copied caller of a CLASS claim is handed vLLM's positions only through this."""
        return None

    def base_forward(self, claim: Claim, parts: "BaseForward") -> None:
        """Adjust the base model's copied forward (the layer loop, what follows it)."""

    def loader(self, claim: Claim) -> "LoaderHook | None":
        """A transform of the checkpoint's tensors before the loader reads them."""
        return None

    def helpers(self, claim: Claim) -> tuple[str, ...]:
        """Module-level functions what the claim emitted calls, one text each."""
        return ()

    def dropped_buffers(self, claim: Claim) -> set[str]:
        """Buffers a copied `__init__` registers on the claimed modules that the
        emitted code folds elsewhere: those registrations are not copied."""
        return set()

    def slow_paths(self, claim: Claim) -> tuple[tuple[str, str], ...]:
        """(what, why) for each part the emitted code runs slower than vLLM's own file
        would somewhere (a Python loop on a platform vLLM has no kernel for), reported
        like a refusal."""
        return ()

    def maps_state(self, info: ClassInfo) -> bool:
        """The class keeps state across decode steps besides the KV cache, and this
        pattern would map it onto a vLLM layer that keeps it in vLLM's state cache
        (its claim proves it or says why not)."""
        return False

    def causal_lm(self, claim: Claim, attends: bool) -> "CausalHook | None":
        """vLLM interfaces the causal LM declares, and the methods they ask for
        (`attends`: some layer of the model attends)."""
        return None


@dataclass
class BaseForward:
    """The base model's forward as the assembly stage builds it, for `base_forward`
    hooks: the statements before the layer loop, the loop, those after it, and the
    names carried from layer to layer (and from one pipeline stage to the next)."""

    prelude: list[cst.BaseStatement]
    loop: cst.For
    post: list[cst.BaseStatement]
    carried: list[str]
    # first-rank-only initial values of names added to `carried` (`residual = None`)
    initial: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CausalHook:
    """vLLM interfaces the causal LM gains (`IsHybrid`) and the classmethods they
    require (the state cache's shapes)."""

    interfaces: tuple[str, ...]
    methods: str
    # a class of vLLM's `models/config.py` the architecture is set up with, as vLLM
    # does for its own (`MambaModelConfig` for a model with no attention)
    vllm_config: str = ""


@dataclass(frozen=True)
class LoaderHook:
    """Methods the causal LM gains, and what `load_weights` hands its loader instead of
    the checkpoint's tensors (`self._checkpoint_layout(weights)`) or of the class's
    mapper (`self._built_merges_mapper()`); `{weights}` and `{mapper}` stand for what
    the hooks before it gave."""

    methods: str
    weights: str = "{weights}"
    mapper: str = "{mapper}"
    # its weights expression adds what it loads itself to `loaded` (a set
    # `load_weights` returns with the loader's)
    reports_loaded: bool = False
