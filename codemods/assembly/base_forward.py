"""The base model's forward: the source's, statement for statement, with vLLM's inputs
bound where the source reads transformers' (`position_ids = positions[None]`: vLLM runs
every request's tokens as one sequence, a batch of one), the masks and caches gone
(vLLM's attention masks and caches itself), and the pipeline split made from the
source's own dataflow: statements the stream entering the layer loop depends on run on
the first rank only, the rest (rotary tables, per-layer inputs) on every rank, the loop
runs this rank's layers, and what comes after it (the final norm) runs on the last rank.
Claims adjust the loop and what follows it (`Pattern.base_forward`: the residual the
layers hand on), and hand the layers vLLM's positions where a claimed module needs them.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import BaseForward, code
from fusion_patterns.emitting import with_keyword

from ..copying.classes import Context
from ..copying.definitions import strip_decorators
from ..copying.inference import bind_unfolded, inference_folded
from ..copying.simplify import INFERENCE_PARAMS, loads, simplify_function, stores
from ..errors import CodemodError
from ..roles import Roles

# the masks: vLLM's attention applies the causal mask and windows itself
MASK_MODULES = ("masking_utils", "modeling_attn_mask_utils")


def mask_functions(imports: dict[str, str]) -> set[str]:
    return {
        name
        for name, line in imports.items()
        if any(f".{mod} import" in line for mod in MASK_MODULES)
    }


class _NoMasks(cst.CSTTransformer):
    def __init__(self, names: set[str]):
        self.names = set(names)

    def visit_FunctionDef(self, node):
        # `mask_function = create_causal_mask if ... else create_sliding_window_causal_mask`
        for assign in m.findall(node, m.Assign(targets=[m.AssignTarget(m.Name())])):
            used = {n.value for n in m.findall(assign.value, m.Name())}
            if used & self.names and not m.findall(assign.value, m.Call()):
                self.names.add(assign.targets[0].target.value)
        return True

    def leave_Call(self, original, updated: cst.Call):
        func = updated.func
        if isinstance(func, cst.Name) and func.value in self.names:
            return cst.Name("None")
        if m.matches(func, m.Attribute(value=m.Name("self"))) and "mask" in (
            func.attr.value
        ):
            return cst.Name("None")
        return updated


def _is_layer_loop(stmt, layers_attr: str) -> bool:
    return isinstance(stmt, cst.For) and bool(
        m.findall(
            stmt.iter, m.Attribute(value=m.Name("self"), attr=m.Name(layers_attr))
        )
    )


class _LoopIter(cst.CSTTransformer):
    """`self.layers[:n]` / `self.layers` -> this rank's layers; `enumerate(...)` counts
    from this rank's first layer."""

    def __init__(self, attr: str):
        self.attr = attr

    def leave_Subscript(self, original, updated: cst.Subscript):
        if m.matches(
            updated.value, m.Attribute(value=m.Name("self"), attr=m.Name(self.attr))
        ):
            return cst.parse_expression(
                f"islice(self.{self.attr}, self.start_layer, self.end_layer)"
            )
        return updated

    def leave_Attribute(self, original, updated: cst.Attribute):
        return updated

    def leave_Call(self, original, updated: cst.Call):
        if m.matches(updated.func, m.Name("enumerate")) and not any(
            a.keyword is not None and a.keyword.value == "start" for a in updated.args
        ):
            return updated.with_changes(
                args=[
                    *updated.args[:-1],
                    updated.args[-1].with_changes(
                        comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                    ),
                    cst.Arg(
                        cst.parse_expression("self.start_layer"),
                        keyword=cst.Name("start"),
                        equal=cst.AssignEqual(
                            whitespace_before=cst.SimpleWhitespace(""),
                            whitespace_after=cst.SimpleWhitespace(""),
                        ),
                    ),
                ]
            )
        return updated


class _BareLayers(cst.CSTTransformer):
    def __init__(self, attr: str):
        self.attr = attr
        self.in_subscript = 0

    def visit_Subscript(self, node):
        if m.matches(
            node.value, m.Attribute(value=m.Name("self"), attr=m.Name(self.attr))
        ):
            self.in_subscript += 1

    def leave_Subscript(self, original, updated):
        if m.matches(
            original.value, m.Attribute(value=m.Name("self"), attr=m.Name(self.attr))
        ):
            self.in_subscript -= 1
        return updated

    def leave_Attribute(self, original, updated):
        if not self.in_subscript and m.matches(
            updated, m.Attribute(value=m.Name("self"), attr=m.Name(self.attr))
        ):
            return cst.parse_expression(
                f"islice(self.{self.attr}, self.start_layer, self.end_layer)"
            )
        return updated


def _returned_hidden(ret: cst.Return) -> cst.BaseExpression:
    value = ret.value
    if isinstance(value, cst.Call):
        for a in value.args:
            if a.keyword is not None and a.keyword.value == "last_hidden_state":
                return a.value
        if value.args:
            return value.args[0].value
    if isinstance(value, cst.Tuple):
        return value.elements[0].value
    if value is not None:
        return value
    raise CodemodError("cannot generate: the base model's forward returns nothing")


def base_forward(
    roles: Roles, ctx: Context, claims: list
) -> tuple[str, list[str], str | None]:
    """(the forward's text, the names carried from one pipeline stage to the next, why
    it cannot be split over pipeline stages or None)."""
    info = roles.base
    if info.forward is None:
        raise CodemodError(f"cannot generate: {info.name} has no forward")
    func, params = _inference_form(info.forward, ctx)
    stmts = [
        s
        for s in func.body.body
        if not _raises_only(s)
        and not m.matches(
            s,
            m.SimpleStatementLine([m.Expr(m.SimpleString() | m.ConcatenatedString())]),
        )
    ]
    loops = [i for i, s in enumerate(stmts) if _is_layer_loop(s, roles.layers_attr)]
    if len(loops) != 1:
        raise CodemodError(
            f"cannot generate: {info.name}.forward does not loop once over self.{roles.layers_attr}"
        )
    at = loops[0]
    prelude, loop, post = stmts[:at], stmts[at], stmts[at + 1 :]
    loop = loop.with_changes(
        iter=loop.iter.visit(_BareLayers(roles.layers_attr)).visit(
            _LoopIter(roles.layers_attr)
        )
    )
    returns = [s for s in post if m.matches(s, m.SimpleStatementLine([m.Return()]))]
    if not returns:
        raise CodemodError(f"cannot generate: {info.name}.forward ends in no return")
    hidden = _returned_hidden(returns[-1].body[0])
    post = [s for s in post if s is not returns[-1]]
    carried = _carried(info, params, prelude, loop)
    parts = BaseForward(
        prelude, loop, post, carried + _side_streams(prelude, loop, carried, params)
    )
    for claim in claims:
        claim.pattern.base_forward(claim, parts)
    if set(roles.layer_classes) & ctx.positions:
        # a claimed module inside the layers takes vLLM's positions
        names = {n.value for n in m.findall(loop.target, m.Name())}
        parts.loop = parts.loop.visit(_LayerCall(names))
    first_only, aliases, no_pipeline = _pipeline_split(roles, params, parts)
    lines = _inputs(params, parts, aliases)
    group: list[str] = []

    def flush():
        if group:
            lines.append("if get_pp_group().is_first_rank:")
            lines.extend("    " + line for line in group)
            group.clear()

    for s, only in zip(parts.prelude, first_only):
        text = code(s).strip("\n").splitlines()
        if only:
            group.extend(text)
        else:
            flush()
            lines.extend(text)
    group += [f"{name} = {value}" for name, value in parts.initial.items()]
    flush()
    lines += code(parts.loop).strip("\n").splitlines()
    sent = ", ".join(f'"{n}": {n}[0]' for n in parts.carried)
    lines += [
        "if not get_pp_group().is_last_rank:",
        f"    return IntermediateTensors({{{sent}}})",
    ]
    for s in parts.post:
        lines += code(s).strip("\n").splitlines()
    lines.append(f"return ({code(hidden)})[0]")
    body = "\n".join("        " + line for line in lines)
    return (
        f"""    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
{body}
""",
        parts.carried,
        no_pipeline,
    )


def _inference_form(func: cst.FunctionDef, ctx: Context):
    """(the forward with what vLLM never gives folded away, its parameter names)."""
    func = strip_decorators(func)
    params = {p.name.value for p in m.findall(func.params, m.Param())}
    not_none = {"position_ids"} | ({"cache_position"} & params)
    func = func.visit(_NoMasks(ctx.mask_functions))
    func = inference_folded(func)
    if func.params.star_kwarg is not None:
        # the source's **kwargs (transformers' extra outputs): nothing under vLLM
        star = func.params.star_kwarg.name.value
        func = func.with_changes(body=func.body.visit(_NoStarKwargs(star)))
        func = bind_unfolded(func, {star: "{}"})
    known = {"attention_mask": "None"} if "attention_mask" in params else {}
    # the source's other inputs (token type ids, ...) are never given under vLLM
    provided = {"input_ids", "inputs_embeds", "position_ids", "cache_position", "self"}
    defaults = {
        p.name.value: INFERENCE_PARAMS.get(p.name.value)
        or (code(p.default) if p.default is not None else "None")
        for p in func.params.params
        if p.name.value not in provided and p.name.value not in known
    }
    func = simplify_function(func, {**known, **defaults}, not_none)
    func = bind_unfolded(func, {**known, **defaults})
    func = func.with_changes(body=func.body.visit(_NoInputChecks()))
    return func, params


def _carried(info, params: set[str], prelude, loop) -> list[str]:
    """Names the loop carries from layer to layer (the stream and anything like it)."""
    defined_before = set(params)
    for s in prelude:
        defined_before |= stores(s)
    carried = sorted(
        n
        for n in set(loads(loop.body)) & stores(loop.body) & defined_before
        if n != code(loop.target)
    )
    if not carried:
        raise CodemodError(
            f"cannot generate: {info.name}'s layer loop carries no hidden states"
        )
    return carried


# reading these of the stream is reading its shape, not its values
_SHAPE_ATTRS = {"shape", "dtype", "device", "size", "ndim", "dim"}


def _stream_names(prelude, carried, params: set[str]) -> set[str]:
    """The names the carried stream is computed from before the loop (`inputs_embeds`)."""
    needed = set(carried)
    for stmt in reversed(prelude):
        if stores(stmt) & needed:
            needed |= set(loads(stmt))
    return (needed - params) | {"inputs_embeds"}


def _side_streams(prelude, loop, carried: list[str], params: set[str]) -> list[str]:
    """Names the layers read that the prelude computes from the stream's values, not
    the stream itself (Zamba 2's `original_hidden_states = torch.clone(inputs_embeds)`,
    which every hybrid layer reads): a later pipeline stage has only the incoming
    hidden states in their place, so they travel with them."""
    stored = {"inputs_embeds"}.union(*(stores(s) for s in prelude))
    streams = (_stream_names(prelude, carried, params) & stored) - set(carried)
    read = set(loads(loop.body))
    out: list[str] = []
    for stmt in prelude:
        wanted = (stores(stmt) & read) - set(carried)
        if not wanted:
            continue
        for name in streams:
            uses = len(m.findall(stmt, m.Name(name)))
            shapes = len(
                m.findall(
                    stmt,
                    m.Attribute(
                        value=m.Name(name),
                        attr=m.OneOf(*(m.Name(a) for a in _SHAPE_ATTRS)),
                    ),
                )
            )
            if uses > shapes:
                out += sorted(wanted - set(out))
                break
    return out


def _pipeline_split(roles: Roles, params: set[str], parts: BaseForward):
    """(for each prelude statement, whether only the first rank runs it; names the
    other ranks alias to the incoming stream).

    From the prelude's dataflow: a statement runs on the first rank only if it calls a
    module only the first rank builds (the embeddings), (re)computes the stream the
    loop carries, or reads what only such statements computed; everything else (rotary
    tables, shapes, per-layer inputs) runs on every rank. The stream's own names
    (`inputs_embeds`, ...) stand for the incoming hidden states on the other ranks
    (statements read them for a dtype or a shape)."""
    prelude, carried = parts.prelude, set(parts.carried)
    first_modules = {
        a for a, where in roles.placement.items() if where.startswith("first")
    }
    first_modules.add(roles.vocab_attr.split(".")[0])
    stream_names = _stream_names(prelude, carried, params)
    unavailable: set[str] = set()
    first_only = []
    for stmt in prelude:
        calls_first = any(
            a.attr.value in first_modules
            for a in m.findall(stmt, m.Attribute(value=m.Name("self")))
        )
        only = bool(
            calls_first or stores(stmt) & carried or set(loads(stmt)) & unavailable
        )
        first_only.append(only)
        if only:
            unavailable |= stores(stmt) - carried - stream_names
    every_reads = set(loads(parts.loop)) | set(loads(cst.Module(body=parts.post)))
    defined_first = set()
    for stmt, only in zip(prelude, first_only):
        if only:
            defined_first |= stores(stmt)
        else:
            every_reads |= set(loads(stmt))
    missing = sorted((defined_first & every_reads) - stream_names - carried)
    # a stage after the first would lack it: the file serves one pipeline stage only
    why = (
        f"stages after the first would need {missing[0]} in {roles.base.name}.forward, "
        "which only the first stage computes"
        if missing
        else None
    )
    aliases = sorted((defined_first & every_reads & stream_names) - carried)
    return first_only, aliases, why


def _inputs(params: set[str], parts: BaseForward, aliases: list[str]) -> list[str]:
    """vLLM's inputs bound to the source's names, and the stage's incoming stream."""
    lines: list[str] = [
        "# vLLM runs every request's tokens as one sequence: a batch of one",
        "input_ids = input_ids[None] if input_ids is not None else None",
        "inputs_embeds = inputs_embeds[None] if inputs_embeds is not None else None",
        "position_ids = positions[None]",
    ]
    if "cache_position" in params:
        lines.append("cache_position = positions")
    lines.append("if not get_pp_group().is_first_rank:")
    lines.append("    assert intermediate_tensors is not None")
    for name in parts.carried:
        lines.append(f'    {name} = intermediate_tensors["{name}"][None]')
    for name in aliases:
        lines.append(f"    {name} = {parts.carried[0]}")
    return lines


class _LayerCall(cst.CSTTransformer):
    """The loop's `layer(...)` call hands the layer vLLM's positions."""

    def __init__(self, names: set[str]):
        self.names = names

    def leave_Call(self, original, updated: cst.Call):
        if (
            m.matches(updated.func, m.Name())
            and updated.func.value in self.names
            and not any(
                a.keyword is not None and a.keyword.value == "positions"
                for a in updated.args
            )
        ):
            return with_keyword(updated, "positions", "positions")
        return updated


class _NoStarKwargs(cst.CSTTransformer):
    def __init__(self, name: str):
        self.name = name

    def leave_Call(self, original, updated: cst.Call):
        args = [
            a
            for a in updated.args
            if not (a.star == "**" and m.matches(a.value, m.Name(self.name)))
        ]
        if len(args) == len(updated.args):
            return updated
        if args:
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(args=args)


class _NoInputChecks(cst.CSTTransformer):
    """Branches of the base forward that only raise about its inputs (both or neither of
    input_ids and inputs_embeds): vLLM's inputs never take them, and on later pipeline
    stages the incoming hidden states stand in for the embeddings."""

    @staticmethod
    def _raising(block) -> bool:
        return all(m.matches(s, m.SimpleStatementLine([m.Raise()])) for s in block.body)

    def leave_If(self, original, updated: cst.If):
        node = updated
        if self._raising(node.body):
            orelse = node.orelse
            if orelse is None:
                return cst.RemoveFromParent()
            if isinstance(orelse, cst.If):
                return orelse
            return cst.FlattenSentinel(list(orelse.body.body))
        if isinstance(node.orelse, cst.Else) and self._raising(node.orelse.body):
            return node.with_changes(orelse=None)
        return node

    def leave_SimpleStatementLine(self, original, updated):
        body = [s for s in updated.body if not m.matches(s, m.Expr(m.Name("None")))]
        if not body:
            return cst.RemoveFromParent()
        return updated.with_changes(body=body)


def _raises_only(stmt) -> bool:
    return (
        isinstance(stmt, cst.If)
        and stmt.orelse is None
        and all(
            m.matches(s, m.SimpleStatementLine([m.Raise()])) for s in stmt.body.body
        )
    )
