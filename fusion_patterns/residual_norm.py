"""Pre-norm residual blocks -> `hidden_states, residual = norm(hidden_states, residual)`.

Matched on the decoder layer's forward, a sequence of blocks

    residual = h
    h = self.<norm>(h)
    h = self.<mixer>(h, ...)        # or `h, _ = ...`
    h = self.<post_norm>(h)         # zero or more (Gemma's sandwich norms)
    h = residual + h                # either operand order; or `residual + h * <m>`
                                    # with a multiplier read from `self` (Granite);
                                    # `self.<dropout>(h)` counts as h (Phi-3)

Each block's add is folded into the norm that follows it (the next block's, or the next
layer's, or the model's final norm), as vLLM's native files do: the layer returns the
un-added mixer output and the residual, and vLLM's `RMSNorm(x, residual)` adds and
normalises in one kernel. Anything else in the forward refuses the fusion.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from .base import (
    REWRITE,
    BaseForward,
    Claim,
    ClassInfo,
    FusionRecord,
    Pattern,
    PatternRefused,
    Refusal,
    code,
    self_attr,
)
from .emitting import with_keyword

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
    # applied to the mixer output before the add, in order: norms, then the multiplier
    post_norms: tuple[str, ...] = ()
    multiplier: str | None = None  # source text, reads only `self`


@dataclass(frozen=True)
class LayerSpec:
    class_name: str
    blocks: tuple[Block, ...]


def match(
    info: ClassInfo, norm_attrs: set[str], post_norm_attrs: set[str]
) -> LayerSpec | Refusal | None:
    """`norm_attrs`: proven RMSNorms (the pre-norms the adds fold into);
    `post_norm_attrs`: every norm the layer builds (a post-norm is only called)."""
    if info.forward is None:
        return None
    body = [
        s
        for s in info.forward.body.body
        if not m.matches(s, m.SimpleStatementLine([m.Expr(m.SimpleString())]))
    ]
    # identity at inference; the proof runs the layer in eval mode
    dropouts = {
        a
        for a in info.attrs
        if info.constructed_class(a) in ("nn.Dropout", "torch.nn.Dropout")
    }
    try:
        return LayerSpec(
            info.name, tuple(_blocks(body, norm_attrs, post_norm_attrs, dropouts))
        )
    except PatternRefused as why:
        return Refusal(NAME, info.name, "residual add + norm", str(why))


def _blocks(
    body: list[cst.BaseStatement],
    norm_attrs: set[str],
    post_norm_attrs: set[str],
    dropouts: set[str],
):
    if not body or not m.matches(body[-1], m.SimpleStatementLine([m.Return(m.Name())])):
        raise PatternRefused("forward does not end with `return <hidden states>`")
    h = body[-1].body[0].value.value
    stmts = body[:-1]
    if not stmts:
        raise PatternRefused("forward is not a sequence of pre-norm residual blocks")
    i = 0
    while i < len(stmts):
        if len(stmts) - i < 4:
            raise PatternRefused(
                "forward is not a sequence of pre-norm residual blocks"
            )
        save, norm, mix = stmts[i : i + 3]
        i += 3
        if not m.matches(save, _assign(m.Name(), m.Name(h))):
            raise PatternRefused(f"`{_line(save)}` does not save the residual stream")
        r = save.body[0].targets[0].target.value
        if not m.matches(norm, _assign(m.Name(h), _norm_call(h))):
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
        post = []
        while i < len(stmts) and m.matches(stmts[i], _assign(m.Name(h), _norm_call(h))):
            attr = stmts[i].body[0].value.func.attr.value
            if attr not in post_norm_attrs:
                raise PatternRefused(f"`{_line(stmts[i])}` is not a norm")
            post.append(attr)
            i += 1
        if i >= len(stmts):
            raise PatternRefused("a block ends without its residual add")
        add = stmts[i]
        i += 1
        multiplier = _residual_add(add, r, h, dropouts)
        target = mix.body[0].targets[0].target
        yield Block(
            norm_attr,
            mix.body[0].value.func.attr.value,
            isinstance(target, cst.Tuple),
            tuple(post),
            multiplier,
        )


def _norm_call(h: str) -> m.Call:
    return m.Call(func=self_attr(), args=[_stream_arg(h)])


def _residual_add(
    add: cst.BaseStatement, r: str, h: str, dropouts: set[str]
) -> str | None:
    """The multiplier of `h = r + h [* <m>]` (either operand order), None for a plain
    add; refuses anything else. The multiplier may read only `self` (an attribute the
    generated `__init__` computes the same way)."""
    out = m.Name(h)
    if dropouts:
        out |= m.Call(
            func=self_attr(m.Name(m.MatchIfTrue(lambda name: name in dropouts))),
            args=[m.Arg(m.Name(h))],
        )
    scaled = m.BinaryOperation(left=out, operator=m.Multiply()) | (
        m.BinaryOperation(right=out, operator=m.Multiply())
    )
    stream = out | scaled
    added = m.BinaryOperation(
        left=m.Name(r), operator=m.Add(), right=stream
    ) | m.BinaryOperation(left=stream, operator=m.Add(), right=m.Name(r))
    if not m.matches(add, _assign(m.Name(h), added)):
        raise PatternRefused(f"`{_line(add)}` is not the residual add")
    value = add.body[0].value
    other = value.right if m.matches(value.left, m.Name(r)) else value.left
    if m.matches(other, out):
        return None
    factor = other.right if m.matches(other.left, out) else other.left
    names = {n.value for n in m.findall(factor, m.Name())} - {
        a.attr.value for a in m.findall(factor, m.Attribute())
    }
    if names - {"self"} or m.findall(factor, m.Call()):
        raise PatternRefused(
            f"the residual multiplier `{code(factor)}` reads more than `self`"
        )
    return code(factor)


def _line(stmt: cst.BaseStatement) -> str:
    return code(stmt).strip().splitlines()[0]


def records(spec: LayerSpec, vllm_norms: dict[str, str]) -> list[FusionRecord]:
    """`vllm_norms`: {norm attr: vLLM norm class} of the layer."""
    return [
        FusionRecord(
            NAME,
            spec.class_name,
            ("residual add", block.norm),
            block.norm,
            f"{vllm_norms[block.norm]}(x, residual)",
        )
        for block in spec.blocks
    ]


def kept(spec: LayerSpec) -> list[str]:
    """What each block computes between its mixer and the add, emitted as is."""
    out = []
    for block in spec.blocks:
        for post in block.post_norms:
            out.append(
                f"self.{post} on self.{block.mixer}'s output, before the residual add ({spec.class_name})"
            )
        if block.multiplier is not None:
            out.append(
                f"self.{block.mixer}'s output scaled by `{block.multiplier}` before the residual add ({spec.class_name})"
            )
    return out


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


def prove(spec: LayerSpec, layer, call=None) -> None:
    """`call`: (args, kwargs, output) of the layer in the tiny model: the proof runs it
    with the same other inputs (rotary tables, masks) and its own hidden states."""
    import copy

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

    args, kwargs = ((), {}) if call is None else copy.deepcopy(call[:2])
    given = kwargs.pop("hidden_states", None)
    weight = getattr(getattr(layer, spec.blocks[0].norm), "weight", None)
    if args and isinstance(args[0], torch.Tensor):
        shape = tuple(args[0].shape)
    elif weight is not None:
        shape = (1, 6, weight.shape[-1])
    elif isinstance(given, torch.Tensor):
        shape = tuple(given.shape)
    else:
        raise PatternRefused("the layer's width is neither a norm weight nor an input")
    saved = {b.mixer: getattr(layer, b.mixer) for b in spec.blocks}
    try:
        for i, block in enumerate(spec.blocks):
            object.__setattr__(
                layer, block.mixer, _StandIn(shape[-1], i, block.unpacks)
            )
            layer._modules.pop(block.mixer, None)
        with torch.no_grad():
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
            theirs = layer(x, *args[1:], **kwargs)
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
                for post in block.post_norms:
                    h = getattr(layer, post)(h)
                if block.multiplier is not None:
                    h = h * eval(block.multiplier, {"self": layer})
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


# --- the pattern: a rewrite of the copied decoder layer and of the base model's loop ----

WHAT = "residual add + norm"
CARRIED = "residual"  # the name the base model's loop carries the residual stream under


@dataclass(frozen=True)
class Fold:
    layer: LayerSpec
    stream: str  # the layer's hidden-states parameter
    saved: str  # the layer's name for the saved stream (its residual)
    final_norm: (
        str | None
    )  # the base model's proven final norm, the last add folds into


class ResidualFold(Pattern):
    """Every decoder layer a sequence of pre-norm residual blocks whose norms are proven
    RMSNorms: each add is folded into the norm after it (the next block's, the next
    layer's, or the base model's final norm), as vLLM's native files do."""

    name = NAME

    def claim(self, model):
        norms = set(model.norm_specs())
        norm_like = model.norm_classes()
        folds = {}
        for n in model.roles.layer_classes:
            info = model.classes[n]
            proven = {a for a in info.attrs if info.constructed_class(a) in norms}
            every = {a for a in info.attrs if info.constructed_class(a) in norm_like}
            spec = match(info, proven, every)
            if spec is None:
                return
            try:
                if isinstance(spec, Refusal):
                    raise PatternRefused(spec.reason)
                folds[n] = _fold(model, info, spec)
                for _, layer in model.probe.instances.get(n, [])[:1]:
                    prove(spec, layer, model.call(layer))
            except PatternRefused as why:
                yield Refusal(NAME, n, WHAT, str(why))
                return
            except Exception as exc:  # a proof that cannot run is a refusal
                text = str(exc).splitlines()[0] if str(exc) else ""
                yield Refusal(
                    NAME, n, WHAT, f"proof failed to run: {type(exc).__name__}: {text}"
                )
                return
        if not folds:
            return
        try:
            final = _final_norm(model, norms)
        except PatternRefused as why:
            for n in folds:
                yield Refusal(NAME, n, WHAT, str(why))
            return
        for n, fold in folds.items():
            fold = Fold(fold.layer, fold.stream, fold.saved, final)
            info = model.classes[n]
            vllm_norms = {
                a: model.norm_specs()[info.constructed_class(a)].vllm_class
                for a in info.attrs
                if info.constructed_class(a) in norms
            }
            yield Claim(
                self,
                n,
                fold,
                REWRITE,
                records=records(spec_of(fold), vllm_norms),
                carries_residual=True,
            )

    def rewrite_class(self, claim: Claim, node: cst.ClassDef) -> cst.ClassDef:
        fold = claim.spec
        body = []
        for stmt in node.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                stmt = _fold_forward(stmt, fold)
            body.append(stmt)
        return node.with_changes(body=node.body.with_changes(body=body))

    def base_forward(self, claim: Claim, parts: BaseForward) -> None:
        if CARRIED in parts.carried:
            return  # another layer class's claim adapted the loop already
        fold = claim.spec
        stream = parts.carried[0]
        parts.loop = parts.loop.visit(_LayerCall(stream))
        parts.carried.append(CARRIED)
        parts.initial[CARRIED] = "None"
        at = next(
            (
                i
                for i, s in enumerate(parts.post)
                if fold.final_norm
                and m.matches(s, _assign(m.Name(stream), _norm_call(stream)))
                and s.body[0].value.func.attr.value == fold.final_norm
            ),
            None,
        )
        if at is not None:
            parts.post[at] = cst.parse_statement(
                f"# the last layer's residual add, fused into the final norm\n"
                f"{stream}, _ = self.{fold.final_norm}({stream}, {CARRIED})\n"
            )
        else:  # no final norm to fold it into: the last add, as the source has it
            parts.post.insert(
                0, cst.parse_statement(f"{stream} = {stream} + {CARRIED}\n")
            )


def spec_of(fold: Fold) -> LayerSpec:
    return fold.layer


def _fold(model, info: ClassInfo, spec: LayerSpec) -> Fold:
    params = [
        p.name.value for p in info.forward.params.params if p.name.value != "self"
    ]
    if not params:
        raise PatternRefused("forward takes no hidden states")
    body = [s for s in info.forward.body.body if not _docstring(s)]
    saved = {s.body[0].targets[0].target.value for s in body if _saves(s, params[0])}
    if len(saved) != 1:
        raise PatternRefused("the blocks save the stream under different names")
    name = saved.pop()
    if name in params:
        raise PatternRefused(f"`{name}` is also a parameter of forward")
    _loop_call(model, params[0])
    return Fold(spec, params[0], name, None)


def _docstring(stmt) -> bool:
    return m.matches(stmt, m.SimpleStatementLine([m.Expr(m.SimpleString())]))


def _saves(stmt, h: str) -> bool:
    return m.matches(stmt, _assign(m.Name(), m.Name(h)))


def _loop_call(model, layer_stream: str) -> None:
    """The base model's loop hands each layer the stream and stores what it returns,
    and reads the stream nowhere else (between layers it becomes the un-added output).
    """
    base = model.roles.base
    loops = [
        s
        for s in m.findall(base.forward, m.For())
        if m.findall(s.iter, self_attr(model.roles.layers_attr))
    ]
    if len(loops) != 1:
        raise PatternRefused(f"{base.name}.forward does not loop once over its layers")
    loop = loops[0]
    names = {n.value for n in m.findall(loop.target, m.Name())}
    calls = m.findall(
        loop.body,
        m.Assign(value=m.Call(func=m.Name(m.MatchIfTrue(lambda v: v in names)))),
    )
    if len(calls) != 1 or not isinstance(calls[0].targets[0].target, cst.Name):
        raise PatternRefused(
            f"{base.name}'s loop does not assign `<stream> = <layer>(...)` once"
        )
    stream = calls[0].targets[0].target.value
    keywords = {id(a.keyword) for a in m.findall(loop.body, m.Arg()) if a.keyword}
    reads = [n for n in m.findall(loop.body, m.Name(stream)) if id(n) not in keywords]
    if len(reads) != 2:  # the call's argument and the assignment's target
        raise PatternRefused(
            f"{base.name}'s loop reads `{stream}` besides handing it to the layer"
        )


def _final_norm(model, norms: set[str]) -> str | None:
    """The base model's norm applied right after the loop, if it is a proven RMSNorm."""
    base = model.roles.base
    loops = [
        s
        for s in base.forward.body.body
        if isinstance(s, cst.For)
        and m.findall(s.iter, self_attr(model.roles.layers_attr))
    ]
    if not loops:
        raise PatternRefused(
            f"{base.name}.forward loops over its layers inside a block"
        )
    after = list(base.forward.body.body)
    after = after[after.index(loops[0]) + 1 :]
    first = next(iter(after), None)
    if first is None or not m.matches(
        first, _assign(m.Name(), m.Call(func=self_attr()))
    ):
        return None
    attr = first.body[0].value.func.attr.value
    return attr if base.constructed_class(attr) in norms else None


def _fold_forward(func: cst.FunctionDef, fold: Fold) -> cst.FunctionDef:
    h, r = fold.stream, fold.saved
    out: list[cst.BaseStatement] = []
    stmts = list(func.body.body)
    block = 0
    i = 0
    while i < len(stmts):
        s = stmts[i]
        if _saves(s, h) and i + 1 < len(stmts):
            norm = stmts[i + 1].body[0].value.func.attr.value
            if block == 0:
                text = (
                    f"if {r} is None:\n"
                    f"    {r} = {h}\n"
                    f"    {h} = self.{norm}({h})\n"
                    "else:\n"
                    "    # the previous layer's residual add, fused into this norm\n"
                    f"    {h}, {r} = self.{norm}({h}, {r})\n"
                )
            else:
                text = f"{h}, {r} = self.{norm}({h}, {r})\n"
            out.append(cst.parse_statement(text))
            block += 1
            i += 2
            continue
        if _adds(s, h, r):
            kept = _without_residual(s.body[0].value, r)
            if not m.matches(kept, m.Name(h)):
                out.append(s.with_changes(body=[s.body[0].with_changes(value=kept)]))
            i += 1
            continue
        if m.matches(s, m.SimpleStatementLine([m.Return(m.Name(h))])):
            out.append(cst.parse_statement(f"return {h}, {r}\n"))
            i += 1
            continue
        out.append(s)
        i += 1
    param = cst.Param(
        cst.Name(r),
        annotation=cst.Annotation(cst.parse_expression("torch.Tensor | None")),
        default=cst.Name("None"),
    )
    params = func.params
    if isinstance(params.star_arg, cst.Param) or params.kwonly_params:
        params = params.with_changes(kwonly_params=[*params.kwonly_params, param])
    else:
        params = params.with_changes(params=[*params.params, param])
    return func.with_changes(
        params=params, body=func.body.with_changes(body=out), returns=None
    )


def _adds(stmt, h: str, r: str) -> bool:
    return m.matches(
        stmt,
        _assign(
            m.Name(h),
            m.BinaryOperation(left=m.Name(r), operator=m.Add())
            | m.BinaryOperation(right=m.Name(r), operator=m.Add()),
        ),
    )


def _without_residual(value: cst.BinaryOperation, r: str) -> cst.BaseExpression:
    other = value.right if m.matches(value.left, m.Name(r)) else value.left
    return other


class _LayerCall(cst.CSTTransformer):
    """`h = layer(h, ...)` -> `h, residual = layer(h, ..., residual=residual)`."""

    def __init__(self, stream: str):
        self.stream = stream

    def leave_Assign(self, original, updated: cst.Assign):
        if not (
            m.matches(updated.targets[0].target, m.Name(self.stream))
            and isinstance(updated.value, cst.Call)
            and m.findall(updated.value, m.Name(self.stream))
        ):
            return updated
        call = with_keyword(updated.value, CARRIED, CARRIED)
        target = cst.parse_expression(f"{self.stream}, {CARRIED}")
        return updated.with_changes(targets=[cst.AssignTarget(target)], value=call)
