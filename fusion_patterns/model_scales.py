"""Arithmetic on the embeddings and the logits, kept exactly as the source computes it.

Not fusions, but a model without them loads, runs and is wrong, so each form is
matched here and everything else refuses generation. Matched forms:

- an embedding class built on `nn.Embedding` whose forward returns
  `super().forward(ids) * self.<s>` (or `* self.<s>.to(self.weight.dtype)`), `self.<s>`
  set from a constructor argument (Gemma: `embed_scale=hidden_size**0.5`);
- `<embeds> = <embeds> * <m>` in the base model's forward, `<m>` reading only `self`
  (Granite's `embedding_multiplier`);
- on the logits after the head: `logits = logits / <c>`, `logits = logits * <c>`, and
  the soft-cap `logits / <c>`, `torch.tanh(logits)`, `logits * <c>`, optionally under
  `if <c> is not None:` (Gemma 2). vLLM's `LogitsProcessor` applies the soft-cap then
  the scale, so a scale before a soft-cap is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from .base import ClassInfo, PatternRefused, code, self_attr

EMBEDDING_BASES = ("nn.Embedding", "torch.nn.Embedding")
MUL_DIV = m.BinaryOperation(operator=m.Multiply() | m.Divide())
TANH = m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("tanh")))


@dataclass(frozen=True)
class EmbeddingScale:
    factor: str  # source text, evaluated in the generated model's forward
    # `self.<a> = <value>` lines the factor needs, for the generated `__init__`
    init_lines: tuple[str, ...]
    # applied by the embedding module (token ids only), not to given inputs_embeds
    in_embedding: bool
    cast: bool  # the factor is a tensor cast to the embeddings' dtype first

    def describe(self) -> str:
        where = "in the embedding" if self.in_embedding else "in the model's forward"
        defs = "".join(f"; {line}" for line in self.init_lines)
        return f"embeddings scaled by `{self.factor}` {where}{defs}"


@dataclass(frozen=True)
class LogitsSpec:
    scale: str | None = None  # source text for LogitsProcessor(scale=...)
    soft_cap: str | None = None  # source text for LogitsProcessor(soft_cap=...)
    init_lines: tuple[str, ...] = field(default=())

    def describe(self) -> list[str]:
        out = []
        if self.soft_cap:
            out.append(f"logits soft-capped at `{self.soft_cap}`")
        if self.scale:
            out.append(f"logits scaled by `{self.scale}`")
        return out


def is_embedding(cls: str | None, classes: dict[str, ClassInfo]) -> bool:
    if cls in EMBEDDING_BASES:
        return True
    info = classes.get(cls or "")
    return info is not None and any(b in EMBEDDING_BASES for b in info.bases)


def _self_only(expr: cst.BaseExpression, what: str) -> list[str]:
    """The `self.<a>` attributes `expr` reads; refuses any other free name or a call."""
    attrs = [a for a in m.findall(expr, self_attr()) if isinstance(a, cst.Attribute)]
    attr_names = {a.attr.value for a in m.findall(expr, m.Attribute())}
    free = {n.value for n in m.findall(expr, m.Name())} - attr_names - {"self"}
    if free or m.findall(expr, m.Call()):
        raise PatternRefused(f"{what} `{code(expr)}` reads more than `self`")
    return list(dict.fromkeys(a.attr.value for a in attrs))


def _copied_attrs(owner: ClassInfo, names: list[str]) -> tuple[str, ...]:
    """`self.<a> = <value>` from the owner's `__init__` for each plain attribute read
    (`self.config` is set by every generated class already)."""
    lines = []
    for name in names:
        if name == "config":
            continue
        if name not in owner.attrs:
            raise PatternRefused(f"self.{name} is not set in {owner.name}.__init__")
        lines.append(f"self.{name} = {code(owner.attrs[name])}")
    return tuple(lines)


def _assigns(stmt: cst.CSTNode) -> tuple[str | None, cst.BaseExpression | None]:
    """(target name, value) of `x = v` / `x: T = v`, else (None, None)."""
    if m.matches(stmt, m.SimpleStatementLine([m.Assign([m.AssignTarget(m.Name())])])):
        a = stmt.body[0]
        return a.targets[0].target.value, a.value
    if m.matches(stmt, m.SimpleStatementLine([m.AnnAssign(target=m.Name())])):
        a = stmt.body[0]
        return a.target.value, a.value
    return None, None


def _statements(body: cst.BaseSuite):
    """Every simple statement line, into `if` blocks, in source order."""
    for stmt in body.body:
        if isinstance(stmt, cst.If):
            yield from _statements(stmt.body)
            if stmt.orelse is not None:
                yield from _statements(stmt.orelse.body)
        elif isinstance(stmt, cst.SimpleStatementLine):
            yield stmt


def embedding_scale(
    base: ClassInfo, embed_attr: str, classes: dict[str, ClassInfo]
) -> EmbeddingScale | None:
    """The scale on the embeddings, from the embedding class or the base forward."""
    found: list[EmbeddingScale] = []
    cls = classes.get(base.constructed_class(embed_attr) or "")
    if cls is not None and cls.forward is not None:
        if scale := _embedding_class_scale(cls, base.attrs[embed_attr]):
            found.append(scale)
    if base.forward is not None:
        embeds, matched = None, set()
        for stmt in _statements(base.forward.body):
            name, value = _assigns(stmt)
            if value is None:
                continue
            if m.matches(value, m.Call(func=self_attr(embed_attr))):
                embeds = name
            elif embeds is not None and name == embeds and m.matches(value, MUL_DIV):
                found.append(_forward_scale(base, value, embeds))
                matched |= {id(op) for op in m.findall(value, MUL_DIV | TANH)}
        for op in m.findall(base.forward, MUL_DIV | TANH):
            if id(op) not in matched:
                raise PatternRefused(
                    f"{base.name}.forward computes `{code(op)}` on the model's streams"
                )
    if len(found) > 1:
        raise PatternRefused("the embeddings are scaled twice")
    return found[0] if found else None


def _embedding_class_scale(cls: ClassInfo, call: cst.Call) -> EmbeddingScale | None:
    returns = m.findall(cls.forward, m.Return())
    scale_attr = m.SaveMatchedNode(m.Name(), "s")
    factor = self_attr(scale_attr) | m.Call(
        func=m.Attribute(value=self_attr(scale_attr), attr=m.Name("to")),
        args=[m.Arg(self_attr("weight") | m.Attribute(value=self_attr("weight")))],
    )
    super_forward = m.Call(
        func=m.Attribute(value=m.Call(func=m.Name("super")), attr=m.Name("forward"))
    )
    scaled = m.BinaryOperation(left=super_forward, operator=m.Multiply(), right=factor)
    if len(returns) != 1:
        raise PatternRefused(f"{cls.name}.forward has {len(returns)} returns")
    if m.matches(returns[0].value, super_forward):
        return None
    got = m.extract(returns[0].value, scaled)
    if got is None:
        raise PatternRefused(
            f"{cls.name}.forward computes `{code(returns[0].value)}`, not a scaled lookup"
        )
    attr = got["s"].value
    value = cls.attrs.get(attr)
    if value is None or cls.init is None:
        raise PatternRefused(f"self.{attr} of {cls.name} is not set in its __init__")
    params = [p.name.value for p in cls.init.params.params if p.name.value != "self"]
    # self.<s> = <param>   |   self.<s> = nn.Buffer(torch.tensor(<param>), ...)
    param_refs = [n.value for n in m.findall(value, m.Name()) if n.value in params]
    if len(param_refs) != 1:
        raise PatternRefused(
            f"self.{attr} of {cls.name} is not one constructor argument"
        )
    param = param_refs[0]
    positional = [a.value for a in call.args if a.keyword is None]
    keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
    index = params.index(param)
    if param in keywords:
        arg = keywords[param]
    elif index < len(positional):
        arg = positional[index]
    else:
        default = cls.init.params.params[index + 1].default
        if default is None:
            raise PatternRefused(f"{cls.name}(...) without `{param}`")
        arg = default
    tensor = bool(m.findall(value, m.Call(func=m.Attribute(attr=m.Name("tensor")))))
    cast = tensor and isinstance(returns[0].value.right, cst.Call)
    if tensor and not cast:
        raise PatternRefused(f"{cls.name}.forward multiplies by an uncast tensor")
    _self_only(arg, "the embedding scale")
    return EmbeddingScale(
        "self.embed_scale", (f"self.embed_scale = {code(arg)}",), True, cast
    )


def _forward_scale(
    base: ClassInfo, value: cst.BinaryOperation, embeds: str
) -> EmbeddingScale:
    if not isinstance(value.operator, cst.Multiply):
        raise PatternRefused(f"{base.name}.forward divides the embeddings")
    factor = value.right if m.matches(value.left, m.Name(embeds)) else value.left
    if not m.matches(value.left, m.Name(embeds)) and not m.matches(
        value.right, m.Name(embeds)
    ):
        raise PatternRefused(f"`{code(value)}` does not scale the embeddings")
    attrs = _self_only(factor, "the embedding multiplier")
    return EmbeddingScale(code(factor), _copied_attrs(base, attrs), False, False)


def logits_spec(causal: ClassInfo, head_attr: str) -> LogitsSpec:
    """Scale and soft-cap of the logits, from the causal LM's forward."""
    if causal.forward is None:
        return LogitsSpec()
    logits, head_inputs, ops = None, set(), []
    for stmt in _statements(causal.forward.body):
        name, value = _assigns(stmt)
        if value is None:
            continue
        if m.matches(value, m.Call(func=self_attr(head_attr))):
            logits = name
            head_inputs = {n.value for n in m.findall(value.args[0].value, m.Name())}
        elif logits is not None and name == logits:
            ops.append(value)
        elif logits is None and name in head_inputs | {"hidden_states"}:
            if m.findall(value, MUL_DIV | TANH):
                raise PatternRefused(
                    f"{causal.name}.forward computes `{code(value)}` before the head"
                )
    if logits is None:
        raise PatternRefused(f"{causal.name}.forward does not call self.{head_attr}")
    return _logits_ops(causal, logits, ops)


def _logits_ops(
    causal: ClassInfo, logits: str, ops: list[cst.BaseExpression]
) -> LogitsSpec:
    def by(op: type) -> m.BinaryOperation:
        return m.BinaryOperation(
            left=m.Name(logits),
            operator=m.Multiply() if op is cst.Multiply else m.Divide(),
        )

    scales: list[str] = []
    soft_cap = None
    read: list[str] = []
    i = 0
    while i < len(ops):
        a = ops[i]
        if (
            i + 2 < len(ops)
            and m.matches(a, by(cst.Divide))
            and m.matches(
                ops[i + 1], m.Call(func=TANH.func, args=[m.Arg(m.Name(logits))])
            )
            and m.matches(ops[i + 2], by(cst.Multiply))
            and code(a.right) == code(ops[i + 2].right)
        ):
            if scales or soft_cap:
                raise PatternRefused(
                    "the logits are scaled or soft-capped before a soft-cap "
                    "(vLLM applies the soft-cap first)"
                )
            read += _self_only(a.right, "the logits soft-cap")
            soft_cap = code(a.right)
            i += 3
        elif m.matches(a, by(cst.Multiply)):
            read += _self_only(a.right, "the logits multiplier")
            scales.append(f"({code(a.right)})")
            i += 1
        elif m.matches(a, by(cst.Divide)):
            read += _self_only(a.right, "the logits divisor")
            scales.append(f"1.0 / ({code(a.right)})")
            i += 1
        else:
            raise PatternRefused(
                f"{causal.name}.forward computes `{logits} = {code(a)}` on the logits"
            )
    return LogitsSpec(
        " * ".join(scales) if scales else None,
        soft_cap,
        _copied_attrs(causal, list(dict.fromkeys(read))),
    )
