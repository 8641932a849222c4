"""The causal LM in vLLM's interface: the source's `__init__` with vLLM's head
(`ParallelLMHead`, tied where the source ties it) and logits processor, the tables
every fusion record feeds (`packed_modules_mapping`, the stacked weight mapping), and
`compute_logits`: the source's forward after its base-model call, with the head handed
to vLLM's `LogitsProcessor` (which gathers the vocabulary shards)."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, code

from ..copying.classes import Context, _InitRewrite
from ..copying.inference import inference_folded
from ..errors import CodemodError
from .ranks import _flatten, _rank_guard


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
    # vLLM sets this model type up for MLA, which the copied attention is not
    require_no_mla: bool = False
    # the vocabulary embedding's module name (LoRA's embedding_modules)
    embedding: str = ""
    # splits over pipeline stages (SupportsPP); False: one stage only, vLLM refuses PP
    pipeline: bool = True


@dataclass
class Loading:
    """How `load_weights` reads the checkpoint: the class-level mapper, methods it calls,
    whether per-expert tensors are stacked into copied experts' 3-D parameters, and
    what the claims' loader hooks hand the loader."""

    mapper: str
    methods: str = ""
    stacked: bool = False
    weights: str = "weights"
    mapper_expr: str = "self.hf_to_vllm_mapper"
    # a hook's weights expression adds what it loads itself to `loaded`
    reports_loaded: bool = False
    # vLLM interfaces the claims ask of the causal LM (`IsHybrid`)
    interfaces: tuple[str, ...] = ()
    # checkpoint tensors of modules the file does not build (a tower a text model
    # never runs: `constant_arguments`)
    unbuilt_prefixes: tuple[str, ...] = ()

    def loader(self) -> str:
        skip = (
            f", ignore_unexpected_prefixes={list(self.unbuilt_prefixes)!r}"
            if self.unbuilt_prefixes
            else ""
        )
        return f"AutoWeightsLoader(self{skip})"

    def body(self) -> str:
        lines = ["        loaded: set[str] = set()"] if self.reports_loaded else []
        also = " | loaded" if self.reports_loaded else ""
        if self.stacked:
            lines += [
                "        stacked: set[str] = set()",
                f"        weights = self._stacked_experts({self.mapper_expr}.apply({self.weights}), stacked)",
                f"        return loader.load_weights(weights) | stacked{also}",
            ]
        else:
            lines.append(
                f"        return loader.load_weights({self.weights}, mapper={self.mapper_expr}){also}"
            )
        return "\n".join(lines)


def emit_causal(
    roles: CausalRoles, ctx: Context, packed: dict[str, list[str]], loading: Loading
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
    embeddings = (
        f'{{"{roles.embedding}": "input_embeddings", "{roles.head_attr}": "output_embeddings"}}'
        if roles.embedding
        else f'{{"{roles.head_attr}": "output_embeddings"}}'
    )
    return f"""
class {info.name}({", ".join(("nn.Module", *loading.interfaces, "SupportsLoRA", *(["SupportsPP"] if roles.pipeline else []), "SupportsQuant"))}):
    # merged module -> the checkpoint modules it holds, from the fusion records
    packed_modules_mapping = {{
{packed_lines}
    }}
    embedding_modules = {embeddings}
{loading.mapper}
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
        loader = {loading.loader()}
{loading.body()}
{loading.methods}"""


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
