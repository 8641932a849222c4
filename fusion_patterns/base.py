"""What every fusion pattern shares: the record it produces and the refusal it can give.

A pattern module holds one fusion: its libcst matcher over the transformers source, the
facts it extracts for the emitter, and its contribution to the weight-loading tables.
The records are data, not exceptions: the planner collects them and every table of the
generated file (the rewrite, `packed_modules_mapping`, the stacked weight mapping, the
report) is derived from the same records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        packed = "".join(f", {t}" for t in (self.packed, self.detail) if t)
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

    def constructed_classes(self, attr: str) -> list[str]:
        """Every class `self.<attr>` may be built from, in source order."""
        calls = [v for v in self.choices.get(attr, []) if isinstance(v, cst.Call)]
        return list(dict.fromkeys(filter(None, (dotted_name(c.func) for c in calls))))


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


def is_linear(info: ClassInfo, attr: str) -> bool:
    return info.constructed_class(attr) in ("nn.Linear", "torch.nn.Linear", "Linear")
