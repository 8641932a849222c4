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
    return m.SimpleStatementLine(
        body=[m.Assign(targets=[m.AssignTarget(target=target)], value=value)]
    )


def _stream_arg(h: str) -> m.Arg:
    return m.Arg(value=m.Name(h), keyword=None) | m.Arg(
        value=m.Name(h), keyword=m.Name("hidden_states")
    )


@dataclass(frozen=True)
class Block:
    norm: str
    mixer: str
    unpacks: bool  # `h, _ = self.<mixer>(...)`: the mixer returns a tuple


@dataclass(frozen=True)
class LayerSpec:
    class_name: str
    blocks: tuple[Block, ...]


def match(info: ClassInfo, norm_attrs: set[str]) -> LayerSpec | Refusal | None:
    if info.forward is None:
        return None
    body = [
        s
        for s in info.forward.body.body
        if not m.matches(s, m.SimpleStatementLine([m.Expr(m.SimpleString())]))
    ]
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
        norm_call = m.Call(
            func=self_attr(m.SaveMatchedNode(m.Name(), "n")), args=[_stream_arg(h)]
        )
        if not m.matches(norm, _assign(m.Name(h), norm_call)):
            raise PatternRefused(f"`{_line(norm)}` is not a norm of the saved stream")
        norm_attr = norm.body[0].value.func.attr.value
        if norm_attr not in norm_attrs:
            raise PatternRefused(f"self.{norm_attr} is not an RMSNorm")
        mix_target = m.Name(h) | m.Tuple([m.Element(m.Name(h)), m.ZeroOrMore()])
        if not m.matches(
            mix,
            _assign(
                mix_target,
                m.Call(
                    func=self_attr(),
                    args=[m.ZeroOrMore(), _stream_arg(h), m.ZeroOrMore()],
                ),
            ),
        ):
            raise PatternRefused(
                f"`{_line(mix)}` is not a sublayer applied to the normed stream"
            )
        added = m.BinaryOperation(
            left=m.Name(r), operator=m.Add(), right=m.Name(h)
        ) | m.BinaryOperation(left=m.Name(h), operator=m.Add(), right=m.Name(r))
        if not m.matches(add, _assign(m.Name(h), added)):
            raise PatternRefused(f"`{_line(add)}` is not the plain residual add")
        target = mix.body[0].targets[0].target
        yield Block(
            norm_attr, mix.body[0].value.func.attr.value, isinstance(target, cst.Tuple)
        )


def _line(stmt: cst.BaseStatement) -> str:
    return code(stmt).strip().splitlines()[0]


def records(spec: LayerSpec) -> list[FusionRecord]:
    return [
        FusionRecord(
            NAME,
            spec.class_name,
            ("residual add", block.norm),
            block.norm,
            "RMSNorm(x, residual)",
        )
        for block in spec.blocks
    ]


# --- proof -------------------------------------------------------------------------
# Dataflow: block by block, the norm and the add read the same saved stream (the
# layer input, then the previous add), the mixer reads the norm output, and the
# layer returns the last add. Numbers: the layer with its mixers replaced by fixed
# stand-ins, against the fused layout the generated layer uses (add deferred into the
# next norm, `norm(h, residual)` = `norm(h + residual), h + residual`).


class _StandIn:
    """A fixed nonlinear map standing in for a mixer (attention or MLP)."""

    def __init__(self, size: int, seed: int, returns_tuple: bool):
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(size, size, generator=gen) / size**0.5
        self.returns_tuple = returns_tuple

    def __call__(self, *args, **kwargs):
        import torch

        h = kwargs.get("hidden_states", args[0] if args else None)
        out = torch.tanh(h @ self.weight)
        return (out, None) if self.returns_tuple else out


def prove(spec: LayerSpec, layer) -> None:
    import torch

    from .dataflow import require_close, single_call, trace

    graph = trace(layer)
    stream = next(n for n in graph.nodes if n.op == "placeholder")
    for block in spec.blocks:
        norm = single_call(graph, block.norm)
        mixer = single_call(graph, block.mixer)
        if norm.args[:1] != (stream,):
            raise PatternRefused(f"self.{block.norm} does not read the residual stream")
        if norm not in mixer.all_input_nodes:
            raise PatternRefused(
                f"self.{block.mixer} does not read self.{block.norm}'s output"
            )
        adds = [
            u
            for u in stream.users
            if u.op == "call_function" and getattr(u.target, "__name__", "") == "add"
        ]
        if len(adds) != 1 or len(adds[0].all_input_nodes) != 2:
            raise PatternRefused(
                "the residual stream is not added exactly once per block"
            )
        stream = adds[0]
    output = next(n for n in graph.nodes if n.op == "output")
    if output.all_input_nodes != [stream]:
        raise PatternRefused("the layer does not return the last residual add")

    size = getattr(layer, spec.blocks[0].norm).weight.shape[-1]
    saved = {b.mixer: getattr(layer, b.mixer) for b in spec.blocks}
    try:
        for i, block in enumerate(spec.blocks):
            object.__setattr__(layer, block.mixer, _StandIn(size, i, block.unpacks))
            layer._modules.pop(block.mixer, None)
        with torch.no_grad():
            x = torch.randn(1, 6, size, generator=torch.Generator().manual_seed(2))
            theirs = layer(x)
            h, residual = x, None
            for block in spec.blocks:
                norm = getattr(layer, block.norm)
                if residual is None:
                    residual, h = h, norm(h)
                else:
                    residual = h + residual
                    h = norm(residual)
                out = getattr(layer, block.mixer)(h)
                h = out[0] if isinstance(out, tuple) else out
            require_close(
                h + residual,
                theirs,
                f"{spec.class_name} with the residual add fused into the norms",
            )
    finally:
        for name, module in saved.items():
            if name in layer.__dict__:
                object.__delattr__(layer, name)
            layer._modules[name] = module
