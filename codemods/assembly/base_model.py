"""The base model in vLLM's interface: its `__init__` is the source's, statement for
statement, with vLLM's vocabulary embedding, `make_layers` for the layer list (this
rank's layers, `PPMissingLayer`s for the others) and each module built on the pipeline
ranks that use it; its forward is `base_forward.py`'s."""

from __future__ import annotations

import textwrap
import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, code, dotted_name

from ..copying.classes import Context, _InitRewrite
from ..copying.definitions import strip_decorators
from ..copying.inference import inference_folded
from ..copying.positions import refuse_if_still_used
from ..errors import CodemodError
from ..roles import Roles, layer_list_name, layer_loop
from . import layer_builder, tied_modules
from .base_forward import base_forward
from .ranks import KEEP_EVERY_RANK, _flatten, _rank_guard


def emit_base(roles: Roles, ctx: Context, claims: list) -> tuple[str, str | None]:
    """(the class's text, why it cannot be split over pipeline stages or None)."""
    info = roles.base
    body: list[str] = [
        "super().__init__()",
        "config = vllm_config.model_config.hf_config",
        "quant_config = vllm_config.quant_config",
        "self.config = config",
    ]
    rewriter = _InitRewrite(info, ctx)
    dropped = set().union(*(c.pattern.dropped_buffers(c) for c in claims))
    no_pipeline = None
    for stmt in _without_folded(info.init_statements(), dropped):
        body += _base_init_statement(stmt, roles, ctx, rewriter)
        no_pipeline = no_pipeline or _reads_every_layer(stmt, info, roles.layers_attr)
    forward, carried, why = base_forward(roles, ctx, claims)
    no_pipeline = no_pipeline or why
    # the base model's own position count (TrOCR's decoder hands its embedding one)
    refuse_if_still_used(info, textwrap.dedent(forward), base=True)
    keys = ", ".join(f'"{k}"' for k in carried)
    body.append(
        "self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory("
        f"[{keys}], config.hidden_size)"
    )
    init = "\n".join("        " + line for line in _flatten(body))
    methods = _helper_methods(info, forward)
    if roles.layers_method is not None:
        methods.append(layer_builder.builder_method(roles.layers_method, ctx))
    helpers = "\n".join(textwrap.indent(code(h), "    ") for h in methods)
    return (
        f"""
@support_torch_compile
class {info.name}(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
{init}

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.{roles.vocab_attr}(input_ids)

{forward}
{helpers}""",
        no_pipeline,
    )


def _reads_every_layer(
    stmt: cst.BaseStatement, info: ClassInfo, layers_attr: str
) -> str | None:
    """Why `__init__` cannot run on a pipeline stage: a loop over the layer list that
    reads its layers' attributes (Gemma 3n's kv-shared layers), where a stage holds
    placeholders for the other stages' layers. None otherwise."""
    if not isinstance(stmt, cst.For):
        return None
    layers = m.Attribute(value=m.Name("self"), attr=m.Name(layers_attr))
    if not m.findall(stmt.iter, layers):
        return None
    names = {n.value for n in m.findall(stmt.target, m.Name())}
    read = m.findall(
        stmt.body, m.Attribute(value=m.Name(m.MatchIfTrue(lambda v: v in names)))
    )
    if not read:
        return None
    return (
        f"{info.name}.__init__ reads every layer's `{code(read[0])}`, and a pipeline "
        "stage holds only its own layers"
    )


def _helper_methods(info: ClassInfo, forward_text: str) -> list[cst.FunctionDef]:
    """The class's own methods its forward calls (`self.build_alibi(...)`), copied."""
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


def _without_folded(statements: list, buffers: set[str]) -> list:
    """The statements without those registering buffers a pattern folded elsewhere,
    and without the local values only those read (`mup = compute(config)`)."""
    if not buffers:
        return statements
    kept = [s for s in statements if not _registers_only(s, buffers)]
    if len(kept) == len(statements):
        return statements
    out = []
    for i, stmt in enumerate(kept):
        if m.matches(stmt, _LOCAL):
            name = stmt.body[0].targets[0].target.value
            later = kept[i + 1 :]
            if not any(m.findall(s, m.Name(name)) for s in later):
                continue  # read only by what was dropped
        out.append(stmt)
    return out


_LOCAL = m.SimpleStatementLine([m.Assign(targets=[m.AssignTarget(m.Name())])])
_REGISTER = m.Expr(
    m.Call(
        func=m.Attribute(attr=m.Name("register_buffer")),
        args=[m.Arg(m.SimpleString()), m.ZeroOrMore()],
    )
)


def _registers_only(stmt: cst.CSTNode, buffers: set[str]) -> bool:
    """The statement (a loop over the layers, say) does nothing but register buffers
    named in `buffers` on submodules."""
    if isinstance(stmt, (cst.For, cst.If)) and stmt.orelse is None:
        return all(_registers_only(s, buffers) for s in stmt.body.body)
    return (
        isinstance(stmt, cst.SimpleStatementLine)
        and all(m.matches(s, _REGISTER) for s in stmt.body)
        and all(s.value.args[0].value.evaluated_value in buffers for s in stmt.body)
    )


# `self._register_load_state_dict_pre_hook(self.load_hook)` (Mamba 2's old names)
STATE_DICT_HOOK = m.SimpleStatementLine(
    [
        m.Expr(
            m.Call(
                func=m.Attribute(
                    value=m.Name("self"),
                    attr=m.Name(
                        m.MatchRegex(r"_register_(load_)?state_dict_(pre_)?hook")
                    ),
                )
            )
        )
    ]
)


def _base_init_statement(stmt, roles: Roles, ctx: Context, rewriter) -> list[str]:
    if _builds_layer_list(stmt, roles):
        return []  # vLLM's `make_layers` builds them (`_make_layers`)
    if m.matches(stmt, STATE_DICT_HOOK):
        return []  # torch's `load_state_dict` hooks: vLLM's loader never calls them
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
                f"cannot generate: {roles.base.name}.__init__ has an elif chain, not emitted yet"
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
    tied = roles.tied_embedding is not None
    if attr == roles.vocab_attr:
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
        return _rank_guard(line.splitlines(), "first+tied" if tied else "first", tied)
    if attr == roles.layers_attr and roles.layers_method is not None:
        return layer_builder.init_lines(
            roles.layers_method, attr
        ) + tied_modules.init_lines(roles)
    if attr == roles.layers_attr:
        return _make_layers(roles, attr)
    line = code(stmt.visit(rewriter)).strip()
    return _rank_guard(
        line.splitlines(), roles.placement.get(attr, KEEP_EVERY_RANK), tied
    )


def _make_layers(roles: Roles, attr: str) -> list[str]:
    """`nn.ModuleList([Layer(config, i) for i in range(N)])` -> vLLM's `make_layers`,
    which builds this rank's layers and `PPMissingLayer`s for the others."""
    comp = roles.layers_comprehension
    call = comp.elt
    var = code(comp.for_in.target)

    class _Index(cst.CSTTransformer):
        def leave_Name(self, original, updated):
            if updated.value == var:
                return cst.parse_expression("extract_layer_index(prefix)")
            return updated

    args = [code(a.visit(_Index())).rstrip(", ") for a in call.args]
    args += ["quant_config=quant_config", "prefix=prefix"]
    return [
        f"self.start_layer, self.end_layer, self.{attr} = make_layers(",
        f"    {code(comp.for_in.iter.args[0].value)},",
        f"    lambda prefix: {code(call.func.visit(_Index()))}({', '.join(args)}),",
        f'    prefix=f"{{prefix}}.{attr}",',
        ")",
    ]


def _builds_layer_list(stmt, roles: Roles) -> bool:
    """`layers = []` or `for i in range(n): layers.append(Layer(...))`, where the
    decoder layers are `nn.ModuleList(layers)`."""
    name = layer_list_name(roles.base.attrs.get(roles.layers_attr))
    if name is None:
        return False
    return m.matches(stmt, layer_loop(name)) or m.matches(
        stmt,
        m.SimpleStatementLine(
            [m.Assign(targets=[m.AssignTarget(m.Name(name))], value=m.List([]))]
        ),
    )
