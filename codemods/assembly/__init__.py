"""Stage 6: the base model, the wrappers around it, the causal LM (head, logits,
weight loading) around the copied and claimed classes; the source's module-level
definitions the code needs; the imports; whether vLLM may compile the model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass, field

from fusion_patterns.mla import vllm_assumes_mla

from ..copying import Copied, Unfused
from ..copying import eager_attention, vllm_attention
from ..copying import head_rows
from ..copying import config_branches
from ..copying.classes import CONV1D_HELPER
from ..copying.definitions import Definitions, closure, copied_text
from ..plan import Plan
from . import compile, constant_arguments, dead_code, tied_modules, weights
from .base_model import emit_base
from .causal_lm import CausalRoles, Loading, emit_causal
from .imports import imports_for

if TYPE_CHECKING:
    from ..claims import Model

WRAPPER = """
class {name}(nn.Module):
    # a pass-through around the module holding the layers, as in the source
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = vllm_config.model_config.hf_config
        self.{attr} = {inner}(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "{attr}"))
        self.make_empty_intermediate_tensors = self.{attr}.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.{attr}.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.{attr}(input_ids, positions, intermediate_tensors, inputs_embeds)
"""


@dataclass
class Assembled:
    text: str  # imports and classes, unformatted
    unfused: list[Unfused] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)


def assemble(model: Model, copied: Copied, defs: Definitions, plan: Plan) -> Assembled:
    roles, ctx, classes = model.roles, copied.context, model.classes
    out = Assembled("")
    pieces = dict(copied.pieces)
    require_no_mla = bool(ctx.attention) and vllm_assumes_mla(model.config)
    if require_no_mla:
        out.environment["VLLM_MLA_DISABLE"] = "1"
        out.unfused.append(
            Unfused(
                roles.causal.name,
                "latent attention",
                "its attention is emitted from the source on vLLM's standard attention "
                "(expanded keys and values), so vLLM's MLA path must be off: VLLM_MLA_DISABLE=1",
            )
        )
    pieces[roles.base.name], no_pipeline = emit_base(roles, ctx, model.claims)
    if no_pipeline:  # served on one pipeline stage: vLLM refuses PP without SupportsPP
        out.unfused.append(
            Unfused(
                roles.base.name, "pipeline parallel", f"not supported: {no_pipeline}"
            )
        )
    for inner_attr, wrapper in roles.wrappers:
        inner = type(getattr(wrapper, inner_attr)).__name__
        pieces[type(wrapper).__name__] = WRAPPER.format(
            name=type(wrapper).__name__, attr=inner_attr, inner=inner
        )
    # constants the copy hands its modules, folded; modules left returning an input
    # unchanged are not built, their checkpoint tensors skipped
    unbuilt = constant_arguments.fold(pieces, roles.base.name)
    loading = _loading(model, plan)
    loading.unbuilt_prefixes = tuple(
        ".".join([*roles.chain, u.attr]) + "." for u in unbuilt
    )
    out.unfused += [
        Unfused(roles.base.name, "module not built", u.describe(), kept=True)
        for u in unbuilt
    ]
    pieces[roles.causal.name] = emit_causal(
        _causal_roles(model, require_no_mla, pipeline=not no_pipeline),
        ctx,
        plan.packed_modules_mapping(),
        loading,
    )
    keep = {roles.base.name, roles.causal.name} | roles.wrapper_names
    removed = dead_code.prune(pieces, roles, keep, defs.nodes)
    plan.unfused[:] = [u for u in plan.unfused if u.source_class not in removed]
    # a fusion or refusal in a class the file no longer holds is not the file's
    plan.records[:] = [r for r in plan.records if r.source_class not in removed]
    plan.refusals[:] = [r for r in plan.refusals if r.source_class not in removed]
    order = list(classes)
    body = "\n\n".join(pieces[n] for n in sorted(pieces, key=order.index))
    helper = _helpers(ctx, pieces, model.claims)
    body = helper + "\n\n" + body
    # the classes this file defines; a claimed class (a norm whose constructions are
    # vLLM's) is imported from vLLM even where the source names its own alike
    head = imports_for(body, set(pieces))
    # a name the vLLM imports bind (vLLM's GemmaRMSNorm for a claimed norm) is never
    # taken from the source, even where the source defines a class of that name
    names, imports = closure(
        defs,
        head + body,
        set(pieces)
        | _bound_by(head)
        | {"vllm_attention", "vllm_attention_heads", *eager_attention.ALIBI_HELPERS},
    )
    text = copied_text(defs, names)
    # definitions in source order among the classes (constants may name classes)
    blocks = [
        pieces[n] if n in pieces else text[names.index(n)]
        for n in dict.fromkeys(n for n in defs.order if n in pieces or n in names)
    ]
    body = "\n\n".join([helper, *blocks])
    dynamic = compile.data_dependent(body)
    if dynamic:
        owner, construct = dynamic[0]
        base = roles.base.name
        body = body.replace(
            f"@support_torch_compile\nclass {base}(", f"class {base}(", 1
        )
        out.unfused.append(
            Unfused(
                base,
                "torch.compile",
                f"off: {owner} has a data-dependent shape ({construct}), which one "
                "captured graph cannot hold; the model runs eagerly",
            )
        )
        head = head.replace(
            "from vllm.compilation.decorators import support_torch_compile\n", ""
        )
    for owner, iterable in dict.fromkeys(compile.data_loops(body)):
        out.unfused.append(
            Unfused(
                owner,
                "Python loop",
                f"`for ... in {iterable}`: one step per value the batch produces (the "
                "experts it hits), each its own small matmul",
            )
        )
    for claim in model.claims:
        for what, why in claim.pattern.slow_paths(claim):
            out.unfused.append(Unfused(claim.class_name, what, why))
    said = {
        u.source_class
        for u in [*plan.unfused, *out.unfused]  # plan.unfused holds the copy's lines
        if u.what in ("tensor parallel", "config branch")
    }
    out.unfused += _torch_linears(body, said)
    extra = "\n".join(i for i in imports if i not in head.splitlines())
    out.text = head + ("\n" + extra + "\n" if extra else "") + "\n\n" + body
    return out


def _torch_linears(body: str, said: set[str]) -> list[Unfused]:
    """torch's own `nn.Linear`s left in the file (built by a module-level function such
    as CTRL's feed-forward `nn.Sequential`, or with arguments vLLM's linears do not
    take): whole on every rank and outside vLLM's quantization, said once per class or
    function whose other report lines do not already say why."""
    import ast

    out = []
    for node in ast.parse(body).body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name in said:
            continue
        count = sum(
            isinstance(c, ast.Call)
            and ast.unparse(c.func) in ("nn.Linear", "torch.nn.Linear")
            for c in ast.walk(node)
        )
        if count:
            out.append(
                Unfused(
                    node.name,
                    "tensor parallel",
                    f"{count} torch nn.Linear kept as the source builds it: whole on "
                    "every rank, outside vLLM's quantization and LoRA",
                )
            )
    return out


def _bound_by(imports: str) -> set[str]:
    """The names a block of import statements binds."""
    import libcst as cst

    out: set[str] = set()
    for stmt in cst.parse_module(imports).body:
        for small in getattr(stmt, "body", []):
            if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(
                small.names, cst.ImportStar
            ):
                for alias in small.names:
                    bound = alias.asname.name if alias.asname else alias.name
                    out.add(cst.Module(body=[]).code_for_node(bound).split(".")[0])
    return out


def _helpers(ctx, pieces: dict[str, str], claims) -> str:
    """Module-level helpers the copied classes and the claims call."""
    specs = ctx.attention.values()
    helper = (
        vllm_attention.VLLM_ATTENTION_HELPER
        if any(sp.eager is None for sp in specs)
        else ""
    )
    if any(sp.eager is not None for sp in specs):
        helper += eager_attention.HELPER
    helper = helper.replace("attn: Attention", f"attn: {ctx.attention_name}")
    for name, text in eager_attention.ALIBI_HELPERS.items():
        if any(sp.alibi and f"{name}(" in sp.alibi for sp in specs):
            helper += text
    if any("source_layers_for(" in text for text in pieces.values()):
        helper += config_branches.HELPER
    if any("conv1d_layout(" in text for text in pieces.values()):
        helper += CONV1D_HELPER
    if any("shard_head_rows(" in text for text in pieces.values()):
        helper += head_rows.HELPER
    if any("share_tied_weights(" in text for text in pieces.values()):
        helper += tied_modules.SHARE_TIED
    for text in dict.fromkeys(t for c in claims for t in c.pattern.helpers(c)):
        helper += text
    return helper


def _causal_roles(model: Model, require_no_mla: bool, pipeline: bool) -> CausalRoles:
    from fusion_patterns.base import code, linear_args

    roles = model.roles
    causal = roles.causal
    in_size, vocab, bias = linear_args(causal.attrs[roles.head_attr])
    return CausalRoles(
        info=causal,
        model_attr=roles.base_attr,
        base_name=type(getattr(model.probe.model, roles.base_attr)).__name__,
        head_attr=roles.head_attr,
        head_bias=code(bias) != "False",
        vocab=vocab,
        hidden=in_size,
        tied_embedding=roles.tied_embedding,
        last_rank_attrs=roles.last_rank_attrs,
        require_no_mla=require_no_mla,
        embedding=roles.vocab_attr.split(".")[-1],
        pipeline=pipeline,
    )


def _loading(model: Model, plan: Plan) -> Loading:
    causal_cls = type(model.probe.model)
    renames, stacking, fused = weights.conversions(
        causal_cls,
        model.config.model_type,
        [c.experts for c in model.claims if c.experts],
    )
    mapper, methods, weights_arg = weights.loader_code(
        renames, stacking, plan.stacked_params(), fused
    )
    loading = Loading(mapper, methods, stacked=weights_arg == "stacked")
    if tied_modules.ties_modules(model.roles):
        loading.methods += tied_modules.loader_methods(model.roles)
        loading.weights = "self._tied_copies(weights)"
    attends = bool(model.roles.attention)
    for claim in model.claims:
        if (causal := claim.pattern.causal_lm(claim, attends)) is not None:
            loading.interfaces += tuple(
                i for i in causal.interfaces if i not in loading.interfaces
            )
            if causal.methods not in loading.methods:
                loading.methods += causal.methods
            plan.vllm_config = causal.vllm_config or plan.vllm_config
        hook = claim.pattern.loader(claim)
        if hook is None or hook.methods in loading.methods:
            continue
        loading.methods += hook.methods
        loading.reports_loaded |= hook.reports_loaded
        loading.weights = hook.weights.format(weights=loading.weights)
        loading.mapper_expr = hook.mapper.format(mapper=loading.mapper_expr)
    return loading
