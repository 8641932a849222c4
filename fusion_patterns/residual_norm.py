"""Pre-norm residual blocks -> `hidden_states, residual = norm(hidden_states, residual)`.

Matched on the decoder layer's forward, a sequence of blocks

    residual = h
    h = self.<norm>(h)
    h = self.<mixer>(h, ...)        # or `h, _ = ...`
    h = residual + h                # either operand order

Each block's add is folded into the norm that follows it (the next block's, or the next
layer's, or the model's final norm), as vLLM's native files do: the layer returns the
un-added mixer output and the residual, and vLLM's `RMSNorm(x, residual)` adds and
normalises in one kernel. Anything else in the forward refuses the fusion.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from .base import ClassInfo, FusionRecord, PatternRefused, Refusal, code, self_attr

NAME = "residual_norm"


def _assign(target, value) -> m.SimpleStatementLine:
    return m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=target)], value=value)])


def _stream_arg(h: str) -> m.Arg:
    return m.Arg(value=m.Name(h), keyword=None) | m.Arg(value=m.Name(h), keyword=m.Name("hidden_states"))


@dataclass(frozen=True)
class Block:
    norm: str
    mixer: str


@dataclass(frozen=True)
class LayerSpec:
    class_name: str
    blocks: tuple[Block, ...]


def match(info: ClassInfo, norm_attrs: set[str]) -> LayerSpec | Refusal | None:
    if info.forward is None:
        return None
    body = [s for s in info.forward.body.body if not m.matches(s, m.SimpleStatementLine([m.Expr(m.SimpleString())]))]
    try:
        return LayerSpec(info.name, tuple(_blocks(body, norm_attrs)))
    except PatternRefused as why:
        return Refusal(NAME, info.name, "residual add + norm", str(why))


def _blocks(body: list[cst.BaseStatement], norm_attrs: set[str]):
    if not body or not m.matches(body[-1], m.SimpleStatementLine([m.Return(m.Name())])):
        raise PatternRefused("forward does not end with `return <hidden states>`")
    h = body[-1].body[0].value.value
    stmts = body[:-1]
    if len(stmts) % 4 or not stmts:
        raise PatternRefused("forward is not a sequence of pre-norm residual blocks")
    for i in range(0, len(stmts), 4):
        save, norm, mix, add = stmts[i : i + 4]
        if not m.matches(save, _assign(m.Name(), m.Name(h))):
            raise PatternRefused(f"`{_line(save)}` does not save the residual stream")
        r = save.body[0].targets[0].target.value
        norm_call = m.Call(func=self_attr(m.SaveMatchedNode(m.Name(), "n")), args=[_stream_arg(h)])
        if not m.matches(norm, _assign(m.Name(h), norm_call)):
            raise PatternRefused(f"`{_line(norm)}` is not a norm of the saved stream")
        norm_attr = norm.body[0].value.func.attr.value
        if norm_attr not in norm_attrs:
            raise PatternRefused(f"self.{norm_attr} is not an RMSNorm")
        mix_target = m.Name(h) | m.Tuple([m.Element(m.Name(h)), m.ZeroOrMore()])
        if not m.matches(mix, _assign(mix_target, m.Call(func=self_attr(), args=[m.ZeroOrMore(), _stream_arg(h), m.ZeroOrMore()]))):
            raise PatternRefused(f"`{_line(mix)}` is not a sublayer applied to the normed stream")
        added = m.BinaryOperation(left=m.Name(r), operator=m.Add(), right=m.Name(h)) | m.BinaryOperation(
            left=m.Name(h), operator=m.Add(), right=m.Name(r)
        )
        if not m.matches(add, _assign(m.Name(h), added)):
            raise PatternRefused(f"`{_line(add)}` is not the plain residual add")
        yield Block(norm_attr, mix.body[0].value.func.attr.value)


def _line(stmt: cst.BaseStatement) -> str:
    return code(stmt).strip().splitlines()[0]


def records(spec: LayerSpec) -> list[FusionRecord]:
    return [
        FusionRecord(NAME, spec.class_name, ("residual add", block.norm), block.norm, "RMSNorm(x, residual)")
        for block in spec.blocks
    ]
