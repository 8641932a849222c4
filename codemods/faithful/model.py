"""The base model and the causal LM of a faithful file, in vLLM's interface.

The base model's `forward` is the source's, statement for statement, with vLLM's inputs
bound where the source reads transformers' (`position_ids = positions[None]`: vLLM runs
every request's tokens as one sequence, a batch of one), the masks and caches gone
(vLLM's attention masks and caches itself), and the pipeline split made from the
source's own dataflow: statements the stream entering the layer loop depends on run on
the first rank only, the rest (rotary tables, per-layer inputs) on every rank, the loop
runs this rank's layers, and what comes after it (the final norm) runs on the last rank.

The causal LM's `compute_logits` is the source's forward after its base-model call, with
the head handed to vLLM's `LogitsProcessor` (which gathers the vocabulary shards).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, code, dotted_name, linear_args

from ..errors import CodemodError
from .rewrite import (
    Context,
    _InitRewrite,
    _join_blocks,
    bind_unfolded,
    inference_folded,
)
from .simplify import INFERENCE_PARAMS, Fold, loads, simplify_function, stores

# the masks: vLLM's attention applies the causal mask and windows itself
MASK_MODULES = ("masking_utils", "modeling_attn_mask_utils")
KEEP_EVERY_RANK = "every"


@dataclass
class BaseRoles:
    info: ClassInfo
    embed_attr: str
    layers_attr: str
    layer_classes: list[str]
    num_layers: cst.BaseExpression
    layer_call_args: list  # the comprehension's constructor call
    loop_var: str
    # attr -> "first" | "last" | "every": which pipeline ranks build it
    placement: dict[str, str] = field(default_factory=dict)
    tied: bool = False


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


def _rank_guard(lines: list[str], placement: str, tied: bool) -> list[str]:
    if placement == KEEP_EVERY_RANK:
        return lines
    cond = {
        "first": "get_pp_group().is_first_rank",
        "last": "get_pp_group().is_last_rank",
        "first+tied": "get_pp_group().is_first_rank or (config.tie_word_embeddings and get_pp_group().is_last_rank)",
    }[placement]
    comments = []
    while lines and lines[0].lstrip().startswith("#"):
        comments.append(lines[0].strip())
        lines = lines[1:]
    attr = lines[0].split("=", 1)[0].strip()
    return (
        comments
        + [f"if {cond}:"]
        + ["    " + line for line in lines]
        + ["else:", f"    {attr} = PPMissingLayer()"]
    )


def emit_base(roles: BaseRoles, ctx: Context) -> str:
    info = roles.info
    body: list[str] = [
        "super().__init__()",
        "config = vllm_config.model_config.hf_config",
        "quant_config = vllm_config.quant_config",
        "self.config = config",
    ]
    rewriter = _InitRewrite(info, ctx)
    for stmt in info.init_statements():
        body += _base_init_statement(stmt, roles, ctx, rewriter)
    forward, carried = _base_forward(roles, ctx)
    keys = ", ".join(f'"{k}"' for k in carried)
    body.append(
        "self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory("
        f"[{keys}], config.hidden_size)"
    )
    init = "\n".join("        " + line for line in _flatten(body))
    helpers = "\n".join(
        textwrap.indent(code(h), "    ") for h in _helper_methods(info, forward)
    )
    return f"""
@support_torch_compile
class {info.name}(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
{init}

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.{roles.embed_attr}(input_ids)

{forward}
{helpers}"""


def _helper_methods(info: ClassInfo, forward_text: str) -> list[cst.FunctionDef]:
    """The class's own methods its forward calls (`self.build_alibi(...)`), copied."""
    from .definitions import strip_decorators

    methods = {
        s.name.value: s
        for s in info.node.body.body
        if isinstance(s, cst.FunctionDef)
        and s.name.value not in ("__init__", "forward")
    }
    wanted, pending = [], [forward_text]
    while pending:
        text = pending.pop()
        for name, func in methods.items():
            if name not in wanted and f"self.{name}(" in text:
                wanted.append(name)
                pending.append(code(func))
    return [
        inference_folded(strip_decorators(methods[n])) for n in methods if n in wanted
    ]


def _flatten(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        out += line.split("\n")
    return out


def _base_init_statement(stmt, roles: BaseRoles, ctx: Context, rewriter) -> list[str]:
    if m.matches(
        stmt,
        m.SimpleStatementLine(
            [m.Expr(m.Call(func=m.Attribute(value=m.Call(func=m.Name("super")))))]
        ),
    ):
        return []
    if m.matches(
        stmt,
        m.SimpleStatementLine(
            [
                m.Expr(
                    m.Call(
                        func=m.Attribute(value=m.Name("self"), attr=m.Name("post_init"))
                    )
                )
            ]
        ),
    ):
        return []
    if m.matches(
        stmt,
        m.SimpleStatementLine([m.Expr(m.SimpleString() | m.ConcatenatedString())]),
    ):
        return []
    if isinstance(stmt, cst.If):
        out = [f"if {code(stmt.test)}:"]
        for inner in stmt.body.body:
            out += [
                "    " + line
                for line in _flatten(_base_init_statement(inner, roles, ctx, rewriter))
            ]
        orelse = stmt.orelse
        if isinstance(orelse, cst.Else):
            out.append("else:")
            for inner in orelse.body.body:
                out += [
                    "    " + line
                    for line in _flatten(
                        _base_init_statement(inner, roles, ctx, rewriter)
                    )
                ]
        elif orelse is not None:
            raise CodemodError(
                f"cannot generate: {roles.info.name}.__init__ has an elif chain, not emitted yet"
            )
        return out
    if not m.matches(
        stmt,
        m.SimpleStatementLine(
            [m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))])]
        ),
    ):
        return code(stmt).strip("\n").splitlines()
    assign = stmt.body[0]
    attr = assign.targets[0].target.attr.value
    if attr == "gradient_checkpointing":
        return []
    if attr == roles.embed_attr:
        call = assign.value
        cls = dotted_name(call.func) or ""
        if cls in ("nn.Embedding", "torch.nn.Embedding"):
            args = [a.value for a in call.args if a.keyword is None][:2]
            kw = {a.keyword.value: a.value for a in call.args if a.keyword}
            num = args[0] if args else kw["num_embeddings"]
            dim = args[1] if len(args) > 1 else kw["embedding_dim"]
            line = (
                f"self.{attr} = VocabParallelEmbedding({code(num)}, {code(dim)}, "
                f'quant_config=quant_config, prefix=f"{{prefix}}.{attr}")'
            )
        else:  # the source's embedding class, rebased on VocabParallelEmbedding
            line = code(stmt.visit(rewriter)).strip()
        return _rank_guard(
            line.splitlines(), "first+tied" if roles.tied else "first", roles.tied
        )
    if attr == roles.layers_attr:
        return _make_layers(roles, attr)
    line = code(stmt.visit(rewriter)).strip()
    return _rank_guard(
        line.splitlines(), roles.placement.get(attr, KEEP_EVERY_RANK), roles.tied
    )


def _make_layers(roles: BaseRoles, attr: str) -> list[str]:
    """`nn.ModuleList([Layer(config, i) for i in range(N)])` -> vLLM's `make_layers`,
    which builds this rank's layers and `PPMissingLayer`s for the others."""
    call = roles.layer_call_args
    var = roles.loop_var

    class _Index(cst.CSTTransformer):
        def leave_Name(self, original, updated):
            if updated.value == var:
                return cst.parse_expression("extract_layer_index(prefix)")
            return updated

    args = [code(a.visit(_Index())).rstrip(", ") for a in call.args]
    args += ["quant_config=quant_config", "prefix=prefix"]
    return [
        f"self.start_layer, self.end_layer, self.{attr} = make_layers(",
        f"    {code(roles.num_layers)},",
        f"    lambda prefix: {code(call.func)}({', '.join(args)}),",
        f'    prefix=f"{{prefix}}.{attr}",',
        ")",
    ]


def _top_level(stmts) -> list[cst.BaseStatement]:
    return list(stmts)


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


def _base_forward(roles: BaseRoles, ctx: Context) -> tuple[str, list[str]]:
    info = roles.info
    func = info.forward
    if func is None:
        raise CodemodError(f"cannot generate: {info.name} has no forward")
    from .definitions import strip_decorators

    func = strip_decorators(func)
    params = {p.name.value for p in m.findall(func.params, m.Param())}
    not_none = {"position_ids"} | ({"cache_position"} & params)
    func = func.visit(_NoMasks(ctx_mask_functions(ctx)))
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

    # names the loop carries from layer to layer (the stream and anything like it)
    defined_before = set(params)
    for s in prelude:
        defined_before |= stores(s)
    body_stores = stores(loop.body)
    carried = sorted(
        n
        for n in set(loads(loop.body)) & body_stores & defined_before
        if n != code(loop.target)
    )
    if not carried:
        raise CodemodError(
            f"cannot generate: {info.name}'s layer loop carries no hidden states"
        )

    # the pipeline split of the prelude, from its dataflow: a statement runs on the
    # first rank only if it calls a module only the first rank builds (the embeddings),
    # (re)computes the stream the loop carries, or reads what only such statements
    # computed; everything else (rotary tables, shapes, per-layer inputs) runs on every
    # rank. The stream's own names (`inputs_embeds`, ...) stand for the incoming hidden
    # states on the other ranks (statements read them for a dtype or a shape).
    first_modules = {
        a for a, where in roles.placement.items() if where.startswith("first")
    }
    first_modules.add(roles.embed_attr.split(".")[0])
    needed = set(carried)
    for stmt in reversed(prelude):
        if stores(stmt) & needed:
            needed |= set(loads(stmt))
    stream_names = (needed - params) | {"inputs_embeds"}
    unavailable: set[str] = set()
    first_only = []
    for stmt in prelude:
        calls_first = any(
            a.attr.value in first_modules
            for a in m.findall(stmt, m.Attribute(value=m.Name("self")))
        )
        only = bool(
            calls_first or stores(stmt) & set(carried) or set(loads(stmt)) & unavailable
        )
        first_only.append(only)
        if only:
            unavailable |= stores(stmt) - set(carried) - stream_names
    every_reads = set(loads(loop)) | set(loads(cst.Module(body=post)))
    for stmt, only in zip(prelude, first_only):
        if not only:
            every_reads |= set(loads(stmt))
    defined_first = set()
    for stmt, only in zip(prelude, first_only):
        if only:
            defined_first |= stores(stmt)
    aliases = sorted((defined_first & every_reads & stream_names) - set(carried))
    missing = sorted((defined_first & every_reads) - stream_names - set(carried))
    if missing:
        raise CodemodError(
            f"cannot generate: {info.name}.forward: pipeline stages after the first "
            f"would need {missing[0]}, which only the first stage computes"
        )

    lines: list[str] = [
        "# vLLM runs every request's tokens as one sequence: a batch of one",
        "input_ids = input_ids[None] if input_ids is not None else None",
        "inputs_embeds = inputs_embeds[None] if inputs_embeds is not None else None",
        "position_ids = positions[None]",
    ]
    if "cache_position" in params:
        lines.append("cache_position = positions")
    if "attention_mask" in params:
        pass  # folded away: vLLM masks inside its attention
    lines.append("if not get_pp_group().is_first_rank:")
    lines.append("    assert intermediate_tensors is not None")
    for name in carried:
        lines.append(f'    {name} = intermediate_tensors["{name}"][None]')
    for name in aliases:
        lines.append(f"    {name} = {carried[0]}")
    group: list[str] = []

    def flush():
        if group:
            lines.append("if get_pp_group().is_first_rank:")
            lines.extend("    " + line for line in group)
            group.clear()

    for s, only in zip(prelude, first_only):
        text = code(s).strip("\n").splitlines()
        if only:
            group.extend(text)
        else:
            flush()
            lines.extend(text)
    flush()
    lines += code(loop).strip("\n").splitlines()
    sent = ", ".join(f'"{n}": {n}[0]' for n in carried)
    lines += [
        "if not get_pp_group().is_last_rank:",
        f"    return IntermediateTensors({{{sent}}})",
    ]
    for s in post:
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
        carried,
    )


_MASK_FUNCTIONS: set[str] = set()


def ctx_mask_functions(ctx: Context) -> set[str]:
    return getattr(ctx, "mask_functions", set())


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


@dataclass
class CausalRoles:
    info: ClassInfo
    model_attr: str
    base_name: str
    head_attr: str
    head_bias: bool
    vocab: cst.BaseExpression
    hidden: cst.BaseExpression
    tied_embedding: str | None  # the embedding's path below the causal LM
    # module attributes of the causal LM besides the base model and the head (a
    # prediction head before the vocabulary projection): built on the last rank
    last_rank_attrs: set[str] = field(default_factory=set)
    # vLLM sets this model type up for MLA, which the faithful attention is not
    require_no_mla: bool = False


def emit_causal(
    roles: CausalRoles,
    ctx: Context,
    packed: dict[str, list[str]],
    mapper: str,
    layout_methods: str,
    weights_arg: str,
) -> str:
    info = roles.info
    body: list[str] = [
        "super().__init__()",
        "config = vllm_config.model_config.hf_config",
        "quant_config = vllm_config.quant_config",
        "self.config = config",
        "self.quant_config = quant_config",
    ]
    if roles.require_no_mla:
        body += [
            "if vllm_config.model_config.use_mla:",
            "    raise ValueError(",
            f'        "{info.name} is generated with vLLM\'s standard attention (expanded keys "',
            '        "and values), not MLA: run vLLM with VLLM_MLA_DISABLE=1"',
            "    )",
        ]
    rewriter = _InitRewrite(info, ctx)
    for stmt in info.init_statements():
        if (
            m.matches(
                stmt,
                m.SimpleStatementLine(
                    [
                        m.Expr(
                            m.Call(func=m.Attribute(value=m.Call(func=m.Name("super"))))
                        )
                    ]
                ),
            )
            or m.matches(
                stmt,
                m.SimpleStatementLine(
                    [
                        m.Expr(
                            m.Call(
                                func=m.Attribute(
                                    value=m.Name("self"), attr=m.Name("post_init")
                                )
                            )
                        )
                    ]
                ),
            )
            or m.matches(
                stmt,
                m.SimpleStatementLine(
                    [m.Expr(m.SimpleString() | m.ConcatenatedString())]
                ),
            )
        ):
            continue
        target = None
        if m.matches(
            stmt,
            m.SimpleStatementLine(
                [m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))])]
            ),
        ):
            target = stmt.body[0].targets[0].target.attr.value
        if target == roles.model_attr:
            body.append(
                f"self.{target} = {roles.base_name}(vllm_config=vllm_config, "
                f'prefix=maybe_prefix(prefix, "{target}"))'
            )
            continue
        if target == roles.head_attr:
            bias = ", bias=True" if roles.head_bias else ""
            lines = [
                f"self.{target} = ParallelLMHead({code(roles.vocab)}, {code(roles.hidden)}{bias}, "
                f'quant_config=quant_config, prefix=maybe_prefix(prefix, "{target}"))'
            ]
            if roles.tied_embedding:
                lines += [
                    "if config.tie_word_embeddings:",
                    f"    self.{target} = self.{target}.tie_weights(self.{roles.tied_embedding})",
                ]
            body += _rank_guard(lines, "last", False)
            continue
        text = code(stmt.visit(rewriter)).strip("\n").splitlines()
        if target in roles.last_rank_attrs:
            text = _rank_guard(text, "last", False)
        body += text
    body += [
        f"self.logits_processor = LogitsProcessor({code(roles.vocab)})",
        f"self.make_empty_intermediate_tensors = self.{roles.model_attr}.make_empty_intermediate_tensors",
    ]
    packed_lines = ",\n".join(f"        {k!r}: {v!r}" for k, v in packed.items())
    init = "\n".join("        " + line for line in _flatten(body))
    logits = _compute_logits(roles)
    if weights_arg == "stacked":
        load_body = (
            "        stacked: set[str] = set()\n"
            "        weights = self._stacked_experts(self.hf_to_vllm_mapper.apply(weights), stacked)\n"
            "        return loader.load_weights(weights) | stacked"
        )
    else:
        load_body = (
            "        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)"
        )
    return f"""
class {info.name}(nn.Module, SupportsPP, SupportsQuant):
    # merged module -> the checkpoint modules it holds, from the fusion records
    packed_modules_mapping = {{
{packed_lines}
    }}
{mapper}
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
{init}

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.{roles.model_attr}.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.{roles.model_attr}(input_ids, positions, intermediate_tensors, inputs_embeds)

{logits}
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
{load_body}
{layout_methods}"""


def _compute_logits(roles: CausalRoles) -> str:
    """The source's forward after its base-model call, with the head handed to vLLM's
    logits processor (the vocabulary gathered over the TP ranks)."""
    func = roles.info.forward
    stmts = list(func.body.body)
    self_model = m.Attribute(value=m.Name("self"), attr=m.Name(roles.model_attr))
    # self.model(...), or self.model.decoder(...) past a wrapper (OPT)
    model_call = m.Call(func=self_model | m.Attribute(value=self_model))
    at = next((i for i, s in enumerate(stmts) if m.findall(s, model_call)), None)
    if at is None:
        raise CodemodError(
            f"cannot generate: {roles.info.name}.forward does not call self.{roles.model_attr}"
        )
    assign = stmts[at]
    outputs = None
    if m.matches(
        assign, m.SimpleStatementLine([m.Assign(targets=[m.AssignTarget(m.Name())])])
    ):
        outputs = assign.body[0].targets[0].target.value
    elif m.matches(assign, m.SimpleStatementLine([m.AnnAssign(target=m.Name())])):
        outputs = assign.body[0].target.value
    if outputs is None:
        raise CodemodError(
            f"cannot generate: {roles.info.name}.forward does not assign the base model's outputs to a name"
        )
    rest = cst.FunctionDef(
        name=cst.Name("compute_logits"),
        params=func.params,
        body=cst.IndentedBlock(body=stmts[at + 1 :]),
    )

    class _Hidden(cst.CSTTransformer):
        def leave_Attribute(self, original, updated):
            if m.matches(
                updated,
                m.Attribute(value=m.Name(outputs), attr=m.Name("last_hidden_state")),
            ):
                return cst.Name("hidden_states")
            return updated

        def leave_Subscript(self, original, updated):
            if m.matches(updated.value, m.Name(outputs)) and m.matches(
                updated.slice[0], m.SubscriptElement(m.Index(m.Integer("0")))
            ):
                return cst.Name("hidden_states")
            return updated

    rest = rest.visit(_Hidden())
    rest = inference_folded(rest)
    head = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(roles.head_attr)))
    lines: list[str] = ["hidden_states = hidden_states[None]"]
    logits_name = None
    for s in rest.body.body:
        if m.matches(s, m.SimpleStatementLine([m.Return()])):
            value = s.body[0].value
            logits_name = _returned_logits(value, roles)
            break
        calls = m.findall(s, head)
        if calls:
            call = calls[0]
            arg = code(call.args[0].value)
            bias = f", self.{roles.head_attr}.bias" if roles.head_bias else ""
            lines += [
                f"vocab_logits = self.logits_processor(self.{roles.head_attr}, ({arg})[0]{bias})",
                "if vocab_logits is None:  # not the rank that samples",
                "    return None",
            ]

            class _Swap(cst.CSTTransformer):
                def leave_Call(self, original, updated):
                    if m.matches(updated, head):
                        return cst.parse_expression("vocab_logits[None]")
                    return updated

            s = s.visit(_Swap())
        lines += code(s).strip("\n").splitlines()
    if logits_name is None:
        raise CodemodError(
            f"cannot generate: {roles.info.name}.forward returns no logits"
        )
    lines.append(f"return ({logits_name})[0]")
    body = "\n".join("        " + line for line in lines)
    return f"""    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
{body}
"""


def _returned_logits(value, roles) -> str:
    if isinstance(value, cst.Call):
        for a in value.args:
            if a.keyword is not None and a.keyword.value == "logits":
                return code(a.value)
    if isinstance(value, cst.Tuple) and value.elements:
        return code(value.elements[0].value)
    if value is not None:
        return code(value)
    raise CodemodError(f"cannot generate: {roles.info.name}.forward returns no logits")
