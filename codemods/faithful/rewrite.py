"""Copy one source class into the generated file, changing only what vLLM requires.

- `nn.Linear` -> vLLM's parallel linear the TP plan gives it (`return_bias=False`, so
  the call sites stay as they are), or `ReplicatedLinear`; a linear whose `.weight` the
  source reads directly stays an `nn.Linear` (vLLM's CPU build repacks its own).
- a proven norm class -> vLLM's norm; a class some pattern fused -> its fused form
  (built with `quant_config`/`prefix`, like every class that holds vLLM layers).
- the attention-interface call -> vLLM's paged `Attention` (see attention.py).
- transformers' plumbing -> gone: hub-kernel and output-capture decorators, gradient
  checkpointing bases, the cache / output-attentions parameters (folded, simplify.py).
Everything else is the source's code, statement for statement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, code, dotted_name, linear_args
from fusion_patterns.rms_norm import NormSpec

from ..emit.common import norm_construction
from ..errors import CodemodError
from .attention import AttentionSpec
from .eager_attention import CoreRewrite
from .definitions import strip_decorators
from .probe import interface_name
from .simplify import INFERENCE_PARAMS, simplify_function

LINEARS = ("nn.Linear", "torch.nn.Linear")
EMBEDDINGS = ("nn.Embedding", "torch.nn.Embedding")
# transformers bases that are plain modules at inference
PLAIN_BASES = {"GradientCheckpointingLayer", "nn.Module", "torch.nn.Module"}
# TP plan style -> (vLLM class, extra keyword arguments)
STYLES = {
    "colwise": ("ColumnParallelLinear", ""),
    "rowwise": ("RowParallelLinear", ""),
    "colwise_gather_output": ("ColumnParallelLinear", "gather_output=True, "),
    "rowwise_split_input": ("RowParallelLinear", "input_is_parallel=False, "),
    "replicate": ("ReplicatedLinear", ""),
}
# annotation names the copy keeps (others name transformers' types: dropped)
ANNOTATION_NAMES = {
    "torch",
    "nn",
    "int",
    "float",
    "bool",
    "str",
    "tuple",
    "list",
    "dict",
    "None",
    "type",
}

# vLLM's Attention under the name the file imports it as (VllmAttention when the source
# defines a class of its own called Attention)
ATTENTION_NAME = ["Attention"]

VLLM_ATTENTION_HELPER = '''
def vllm_attention(attn: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """transformers' attention-interface layout around vLLM's paged attention:
    [1, heads, tokens, head size] in, [1, tokens, heads, head size] out (vLLM takes and
    returns [tokens, heads * head size])."""
    tokens, size_v = query.shape[2], value.shape[-1]
    if size_v < query.shape[-1]:  # a smaller value head: padded, as vLLM stores one size
        value = nn.functional.pad(value, (0, query.shape[-1] - size_v))
    out = attn(*(t.transpose(1, 2).reshape(tokens, -1) for t in (query, key, value)))
    return out.view(1, tokens, -1, query.shape[-1])[..., :size_v]
'''


@dataclass
class Context:
    """What the rewrite of every class needs to know about the others."""

    classes: dict[str, ClassInfo]
    norms: dict[str, NormSpec]  # proven norm classes -> their vLLM norm
    prefix_classes: set[str]  # classes built with quant_config/prefix
    attention: dict[str, AttentionSpec]
    # class -> attr -> TP style; a linear not in here is replicated
    styles: dict[str, dict[str, str]] = field(default_factory=dict)
    # linear attributes read as `.weight`/`.bias`: kept as nn.Linear
    kept_linears: set[str] = field(default_factory=set)
    # class -> attrs whose head count is divided over the TP ranks
    sharded_attention: set[str] = field(default_factory=set)
    # functions of the source that build attention masks (their calls become None)
    mask_functions: set[str] = field(default_factory=set)
    # (class, attr) -> the source class the tiny model built there, for constructions
    # through a lookup (`CLASSES[config._attn_implementation](config)`)
    built: dict[tuple[str, str], str] = field(default_factory=dict)


def kept_linears(module: cst.Module, classes: dict[str, ClassInfo]) -> set[str]:
    """Attribute names whose `.weight` or `.bias` the source reads somewhere (outside the
    PreTrainedModel classes, whose weight init is not copied)."""
    out = set()
    for node in module.body:
        if isinstance(node, cst.ClassDef) and _is_pretrained(node, classes):
            continue
        for attr in m.findall(
            node,
            m.Attribute(
                value=m.Attribute(attr=m.Name()), attr=m.Name("weight") | m.Name("bias")
            ),
        ):
            out.add(attr.value.attr.value)
    return out


def _is_pretrained(node: cst.ClassDef, classes) -> bool:
    seen = set()
    stack = [node]
    while stack:
        n = stack.pop()
        for base in n.bases:
            name = dotted_name(base.value) or ""
            if name == "PreTrainedModel" or name.endswith(".PreTrainedModel"):
                return True
            if name in classes and name not in seen:
                seen.add(name)
                stack.append(classes[name].node)
    return False


def builds_vllm_layers(info: ClassInfo, ctx_norms, fused: set[str], attention) -> bool:
    if info.name in fused or info.name in attention:
        return True
    return bool(
        info.init
        and (
            m.findall(info.init, m.Call(func=_LINEAR_FUNC))
            or any(
                "vocab_size" in code(c.args[0].value)
                for c in m.findall(info.init, m.Call(func=_EMBEDDING_FUNC))
                if c.args
            )
        )
    )


_EMBEDDING_FUNC = m.Attribute(value=m.Name("nn"), attr=m.Name("Embedding"))
_LINEAR_FUNC = m.Attribute(value=m.Name("nn"), attr=m.Name("Linear")) | m.Attribute(
    value=m.Attribute(value=m.Name("torch"), attr=m.Name("nn")), attr=m.Name("Linear")
)


def prefix_classes(
    classes: dict[str, ClassInfo],
    wanted: set[str],
    fused: set[str],
    attention,
    looked_up: dict | None = None,
) -> set[str]:
    """Classes that hold vLLM layers, directly or through the classes they build: they
    take `quant_config` and `prefix`, and every construction of them passes both."""
    out = {n for n in wanted if builds_vllm_layers(classes[n], None, fused, attention)}
    changed = True
    while changed:
        changed = False
        for name in wanted:
            info = classes[name]
            if name in out or info.init is None:
                continue
            built = {dotted_name(c.func) for c in m.findall(info.init, m.Call())}
            built |= {v for (owner, _), v in (looked_up or {}).items() if owner == name}
            if built & out:
                out.add(name)
                changed = True
    return out


def _clean_annotation(ann: cst.Annotation | None) -> cst.Annotation | None:
    if ann is None:
        return None
    names = {n.value for n in m.findall(ann, m.Name())}
    attrs = {a.attr.value for a in m.findall(ann, m.Attribute())}
    if (names - attrs) <= ANNOTATION_NAMES and not m.findall(ann, m.SimpleString()):
        return ann
    return None


def clean_signature(func: cst.FunctionDef, drop: set[str]) -> cst.FunctionDef:
    """Drop the folded inference parameters and annotations naming transformers' types."""
    params = func.params

    def keep(p):
        return p.name.value not in drop

    def clean(p):
        return p.with_changes(annotation=_clean_annotation(p.annotation))

    new = params.with_changes(
        params=[clean(p) for p in params.params if keep(p)],
        kwonly_params=[clean(p) for p in params.kwonly_params if keep(p)],
        star_arg=(
            clean(params.star_arg)
            if isinstance(params.star_arg, cst.Param)
            else params.star_arg
        ),
        star_kwarg=(
            params.star_kwarg.with_changes(annotation=None)
            if params.star_kwarg
            else None
        ),
    )
    return func.with_changes(params=new, returns=_clean_annotation(func.returns))


def inference_folded(func: cst.FunctionDef) -> cst.FunctionDef:
    """Fold the values of the parameters that carry nothing under vLLM into the body.

    The parameters stay in the signature (callers may pass them by position); calls no
    longer pass them by keyword, since every copied function folds its own."""
    names = {p.name.value for p in m.findall(func.params, m.Param())}
    known = {k: v for k, v in INFERENCE_PARAMS.items() if k in names}
    func = clean_signature(func, set())
    func = func.with_changes(body=func.body.visit(_DropInferenceKwargs()))
    return simplify_function(func, known)


def bind_unfolded(func: cst.FunctionDef, values: dict[str, str]) -> cst.FunctionDef:
    """A removed parameter still read (the function rebinds it on some path) starts
    as the value it always has."""
    from .simplify import loads

    read = set(loads(func.body))
    lines = [f"{k} = {v}" for k, v in values.items() if k in read]
    if not lines:
        return func
    stmts = [cst.parse_statement(line + "\n") for line in lines]
    body = list(func.body.body)
    at = 1 if body and _is_docstring(body[0]) else 0
    return func.with_changes(
        body=func.body.with_changes(body=[*body[:at], *stmts, *body[at:]])
    )


class _DropInferenceKwargs(cst.CSTTransformer):
    """`self.x(..., past_key_values=..., use_cache=...)` -> without those keywords (the
    copied modules no longer take them)."""

    def leave_Call(self, original, updated: cst.Call):
        if not any(
            a.keyword is not None and a.keyword.value in INFERENCE_PARAMS
            for a in updated.args
        ):
            return updated
        func = updated.func
        is_module_call = isinstance(func, cst.Name) or m.matches(
            func, m.Attribute(value=m.Name("self"))
        )
        if not is_module_call:
            return updated
        args = [
            a
            for a in updated.args
            if a.keyword is None or a.keyword.value not in INFERENCE_PARAMS
        ]
        if args:
            args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
        return updated.with_changes(args=args)


def _extras_params(func: cst.FunctionDef) -> cst.FunctionDef:
    """Add `quant_config=None, prefix=""` to an `__init__` (before `*args`/`**kwargs`)."""
    extra = [
        cst.Param(
            cst.Name("quant_config"),
            annotation=cst.Annotation(
                cst.parse_expression("QuantizationConfig | None")
            ),
            default=cst.Name("None"),
        ),
        cst.Param(
            cst.Name("prefix"),
            annotation=cst.Annotation(cst.Name("str")),
            default=cst.SimpleString('""'),
        ),
    ]
    params = func.params
    if isinstance(params.star_arg, cst.Param) or params.kwonly_params:
        new = params.with_changes(kwonly_params=[*params.kwonly_params, *extra])
    else:
        plain = list(params.params)
        if plain and plain[-1].default is None:
            pass
        new = params.with_changes(params=[*plain, *extra])
    return func.with_changes(params=new)


class _InitRewrite(cst.CSTTransformer):
    """Module constructions inside `__init__`, rewritten with their path below the
    module (`self.<attr>`, `.<i>` inside a list or comprehension)."""

    def __init__(self, info: ClassInfo, ctx: Context):
        self.info, self.ctx = info, ctx
        self.path: list[str] = []
        self.base_changed = False

    # path tracking -------------------------------------------------------------
    def visit_Assign(self, node: cst.Assign):
        target = node.targets[0].target
        if m.matches(target, m.Attribute(value=m.Name("self"))):
            self.path.append(target.attr.value)
        else:
            self.path.append("")

    def leave_Assign(self, original, updated):
        self.path.pop()
        return updated

    def visit_ListComp(self, node: cst.ListComp):
        var = node.for_in.target
        self.path.append("{" + var.value + "}" if isinstance(var, cst.Name) else "{_i}")

    def leave_ListComp(self, original, updated):
        self.path.pop()
        return updated

    def _current(self) -> str | None:
        if not self.path or not self.path[0]:
            return None
        return ".".join(p for p in self.path if p)

    # constructions -------------------------------------------------------------
    def leave_Call(self, original: cst.Call, updated: cst.Call):
        path = self._current()
        looked_up = self.ctx.built.get((self.info.name, path or ""))
        if looked_up and isinstance(updated.func, cst.Subscript):
            # a class chosen by the attention implementation: the one transformers' eager
            # path builds (what the proofs ran); vLLM has no implementation of that name
            updated = updated.with_changes(func=cst.Name(looked_up))
        func = dotted_name(updated.func) or ""
        if m.matches(
            updated, m.Call(func=m.Attribute(value=m.Call(func=m.Name("super"))))
        ):
            return updated
        if func in LINEARS:
            return self._linear(updated, path)
        if func in EMBEDDINGS and path is not None:
            args = [a.value for a in updated.args if a.keyword is None]
            kw = {a.keyword.value: a.value for a in updated.args if a.keyword}
            num = args[0] if args else kw.get("num_embeddings")
            dim = args[1] if len(args) > 1 else kw.get("embedding_dim")
            if num is not None and dim is not None and "vocab_size" in code(num):
                return cst.parse_expression(
                    f"VocabParallelEmbedding({code(num)}, {code(dim)}, "
                    f'quant_config=quant_config, prefix=f"{{prefix}}.{path}")'
                )
        if func in self.ctx.norms:
            return cst.parse_expression(
                norm_construction(self.ctx.norms[func], updated)
            )
        if func in self.ctx.prefix_classes:
            if path is None:
                if func in self.ctx.attention or _holds_attention(func, self.ctx):
                    raise CodemodError(
                        f"cannot generate: {self.info.name} builds {func} outside a "
                        "`self.<attr> = ...` statement, so its layer name is unknown"
                    )
                path = "_" + func.lower()
            args = list(updated.args)
            if args:
                args[-1] = args[-1].with_changes(
                    comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                )
            extra = cst.parse_expression(
                f'f(quant_config=quant_config, prefix=f"{{prefix}}.{path}")'
            ).args
            return updated.with_changes(args=[*args, *extra])
        return updated

    def _linear(self, call: cst.Call, path: str | None) -> cst.BaseExpression:
        attr = path if path and "." not in path else None
        keywords = {a.keyword.value for a in call.args if a.keyword is not None}
        if (
            keywords - {"in_features", "out_features", "bias"}
            or (attr or "") in self.ctx.kept_linears
            or path is None
        ):
            return call  # device/dtype arguments or read as a weight: plain torch
        in_size, out_size, bias = linear_args(call)
        style = self.ctx.styles.get(self.info.name, {}).get(attr or "", "replicate")
        cls, extra = STYLES.get(style, STYLES["replicate"])
        text = (
            f"{cls}({code(in_size)}, {code(out_size)}, bias={code(bias)}, {extra}"
            f'quant_config=quant_config, prefix=f"{{prefix}}.{path}", return_bias=False)'
        )
        return cst.parse_expression(text)


def _holds_attention(cls: str, ctx: Context) -> bool:
    info = ctx.classes.get(cls)
    if info is None or info.init is None:
        return False
    built = {dotted_name(c.func) for c in m.findall(info.init, m.Call())}
    return bool(built & set(ctx.attention)) or any(
        _holds_attention(b, ctx) for b in built if b in ctx.classes and b != cls
    )


class _EmbeddingSuper(cst.CSTTransformer):
    """`super().__init__(num, dim, padding_idx)` of an `nn.Embedding` subclass rebased on
    `VocabParallelEmbedding`: the vocabulary and size, sharded like vLLM's own."""

    def leave_Call(self, original, updated: cst.Call):
        if not m.matches(
            updated,
            m.Call(
                func=m.Attribute(
                    value=m.Call(func=m.Name("super")), attr=m.Name("__init__")
                )
            ),
        ):
            return updated
        pos = [a for a in updated.args if a.keyword is None][:2]
        kw = {a.keyword.value: a for a in updated.args if a.keyword is not None}
        args = [
            a.with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT) for a in pos
        ]
        for name in ("num_embeddings", "embedding_dim")[len(pos) :]:
            args.append(
                kw[name].with_changes(keyword=None, equal=cst.MaybeSentinel.DEFAULT)
            )
        extra = cst.parse_expression("f(quant_config=quant_config, prefix=prefix)").args
        args = [
            a.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            for a in args
        ]
        return updated.with_changes(args=[*args, *extra])


class _SuperInit(cst.CSTTransformer):
    def leave_Call(self, original, updated: cst.Call):
        if m.matches(
            updated,
            m.Call(
                func=m.Attribute(
                    value=m.Call(func=m.Name("super")), attr=m.Name("__init__")
                )
            ),
        ):
            return updated.with_changes(args=[])
        return updated


def _attention_init_lines(spec: AttentionSpec, sharded: bool) -> list[str]:
    heads, kv = spec.heads, spec.kv_heads
    lines = []
    if spec.qkv is not None:
        merged = spec.qkv.merged
        # this rank's heads, as the merged projection holds them
        heads, kv = f"self.{merged}.num_heads", f"self.{merged}.num_kv_heads"
        fitted = [
            f"self.{a} = {kv if a in spec.kv_head_attrs else heads}"
            for a in spec.head_attrs
        ]
        if fitted:
            lines += ["# the source's reshapes count this rank's heads", *fitted]
    elif sharded:
        lines += [
            "# tensor parallel: q/k/v are column-parallel, so this rank holds its share",
            "# of the heads (the source's reshapes count heads per rank)",
            "tp_size = get_tensor_model_parallel_world_size()",
            f"assert ({spec.kv_heads}) % tp_size == 0, "
            '"the kv heads must divide over the tensor-parallel ranks"',
        ]
        for attr in spec.head_attrs:
            lines.append(f"self.{attr} = self.{attr} // tp_size")
        if not heads.startswith("self.") or heads[5:] not in spec.head_attrs:
            heads = f"{heads} // tp_size"
        if not kv.startswith("self.") or kv[5:] not in spec.head_attrs:
            kv = f"{kv} // tp_size"
    if spec.sinks and (sharded or spec.qkv is not None):
        name = spec.sinks
        lines += [
            "# the sinks of this rank's heads, each loaded from its slice of the checkpoint tensor",
            f"if {name} is not None:",
            f"    {name} = nn.Parameter(torch.empty({heads}), requires_grad=False)",
            f'    set_weight_attrs({name}, {{"weight_loader": sharded_weight_loader(0)}})',
        ]
    window = spec.window or "None"
    lines += [
        "# vLLM's paged attention serves this module's attention-interface call",
        "cache_config = get_current_vllm_config().cache_config",
        f"sliding_window = {window}",
        "if sliding_window is None and cache_config is not None and cache_config.sliding_window:",
        "    # the source attends fully here: keep vLLM from applying the model-level window",
        "    cache_config = shallow_copy(cache_config)",
        "    cache_config.sliding_window = None",
    ]
    args = [
        heads,
        spec.head_size,
        spec.scale,
        f"num_kv_heads={kv}",
        "cache_config=cache_config",
        "quant_config=quant_config",
        "per_layer_sliding_window=sliding_window",
    ]
    if spec.softcap:
        args.append(f"logits_soft_cap={spec.softcap}")
    if spec.sinks:
        args.append(f"sinks={spec.sinks}")
    if spec.alibi:
        slopes = spec.alibi
        if sharded:  # this rank's heads' slopes
            rank = "get_tensor_model_parallel_rank()"
            slopes = f"{slopes}[{rank} * ({heads}) : ({rank} + 1) * ({heads})]"
        args.append(f"alibi_slopes={slopes}")
    args.append(f'prefix=f"{{prefix}}.{spec.attr}"')
    full = f"self.{spec.attr} = {ATTENTION_NAME[0]}({', '.join(args)})"
    if not spec.chunk:
        return lines + [full]
    # layers attending within aligned chunks: vLLM's chunked local attention
    chunked = [
        heads,
        spec.head_size,
        spec.scale,
        "attention_chunk_size=attention_chunk_size",
        f"num_kv_heads={kv}",
        "cache_config=cache_config",
        "quant_config=quant_config",
        *[a for a in args if a.startswith("alibi_slopes=")],
        f'prefix=f"{{prefix}}.{spec.attr}"',
    ]
    return lines + [
        f"attention_chunk_size = {spec.chunk}",
        "if attention_chunk_size:",
        f"    self.{spec.attr} = ChunkedLocalAttention({', '.join(chunked)})",
        "else:",
        f"    {full}",
    ]


class _InterfaceCall(cst.CSTTransformer):
    """Drop the interface lookup; `iface(self, q, k, v, mask, ...)` -> vLLM."""

    def __init__(self, name: str, attr: str):
        self.name, self.attr = name, attr

    def leave_SimpleStatementLine(self, original, updated):
        body = [s for s in updated.body if not self._assigns_interface(s)]
        if not body:
            return cst.RemoveFromParent()
        # `out, weights = (vllm_attention(...), None)` -> two plain assignments
        if len(body) == 1 and m.matches(
            body[0],
            m.Assign(
                targets=[
                    m.AssignTarget(m.Tuple([m.Element(m.Name()), m.Element(m.Name())]))
                ],
                value=m.Tuple(
                    [
                        m.Element(m.Call(func=m.Name("vllm_attention"))),
                        m.Element(m.Name("None")),
                    ]
                ),
            ),
        ):
            out, weights = (e.value.value for e in body[0].targets[0].target.elements)
            call = body[0].value.elements[0].value
            return cst.FlattenSentinel(
                [
                    updated.with_changes(
                        body=[cst.Assign([cst.AssignTarget(cst.Name(out))], call)]
                    ),
                    cst.SimpleStatementLine(
                        [
                            cst.Assign(
                                [cst.AssignTarget(cst.Name(weights))], cst.Name("None")
                            )
                        ]
                    ),
                ]
            )
        return updated.with_changes(body=body)

    def _assigns_interface(self, stmt) -> bool:
        if isinstance(stmt, cst.Assign):
            return any(m.matches(t.target, m.Name(self.name)) for t in stmt.targets)
        if isinstance(stmt, cst.AnnAssign):
            return m.matches(stmt.target, m.Name(self.name))
        return False

    def leave_If(self, original, updated: cst.If):
        if (
            all(
                isinstance(s, cst.SimpleStatementLine)
                and all(
                    self._assigns_interface(x) or isinstance(x, cst.Pass)
                    for x in s.body
                )
                for s in updated.body.body
            )
            and updated.orelse is None
        ):
            return cst.RemoveFromParent()
        return updated

    def leave_IndentedBlock(self, original, updated):
        if not updated.body:
            return updated.with_changes(body=[cst.SimpleStatementLine([cst.Pass()])])
        return updated

    def leave_Call(self, original, updated: cst.Call):
        if not m.matches(updated.func, m.Name(self.name)):
            return updated
        q, k, v = (code(a.value) for a in updated.args[1:4])
        return cst.parse_expression(
            f"(vllm_attention(self.{self.attr}, {q}, {k}, {v}), None)"
        )


def rewrite_class(info: ClassInfo, ctx: Context, base: str | None = None) -> str:
    """The class, copied with vLLM's layers in; `base` replaces its bases if given."""
    node = strip_decorators(info.node)
    bases = node.bases
    if base is not None:
        bases = [cst.Arg(cst.parse_expression(base))]
    else:
        bases = [
            (
                cst.Arg(cst.parse_expression("nn.Module"))
                if (dotted_name(b.value) or "") in PLAIN_BASES
                else b
            )
            for b in node.bases
        ]
    plain_base = all((dotted_name(b.value) or "") in PLAIN_BASES for b in bases)
    spec = ctx.attention.get(info.name)
    body = []
    for stmt in node.body.body:
        if isinstance(stmt, cst.FunctionDef):
            stmt = strip_decorators(stmt)
            if stmt.name.value == "__init__":
                stmt = _rewrite_init(
                    stmt, info, ctx, plain_base, spec, base == "VocabParallelEmbedding"
                )
            else:
                if spec is not None and stmt.name.value == "forward":
                    if spec.qkv is not None:
                        stmt = stmt.visit(QKVFusion(spec.qkv, fused_names(stmt)))
                    if spec.eager is not None:
                        stmt = stmt.visit(CoreRewrite(spec))
                    else:
                        name = interface_name(info.forward)
                        stmt = stmt.visit(_InterfaceCall(name, spec.attr))
                stmt = inference_folded(stmt)
        body.append(stmt)
    if spec is not None and spec.eager is not None and spec.eager.kind == "method":
        # the replaced attention helper, if nothing else calls it
        others = cst.Module(
            body=[s for s in body if not _defines(s, spec.eager.method)]
        )
        if not m.findall(
            others, m.Attribute(value=m.Name("self"), attr=m.Name(spec.eager.method))
        ):
            body = [s for s in body if not _defines(s, spec.eager.method)]
    node = node.with_changes(
        bases=bases,
        body=node.body.with_changes(body=body),
        lpar=cst.MaybeSentinel.DEFAULT if bases else node.lpar,
        rpar=cst.MaybeSentinel.DEFAULT if bases else node.rpar,
    )
    return code(node)


def _defines(stmt, name: str) -> bool:
    return isinstance(stmt, cst.FunctionDef) and stmt.name.value == name


def _rewrite_init(
    func: cst.FunctionDef,
    info: ClassInfo,
    ctx: Context,
    plain_base: bool,
    spec: AttentionSpec | None,
    rebased_embedding: bool = False,
) -> cst.FunctionDef:
    func = clean_signature(func, set())
    if info.name in ctx.prefix_classes:
        func = _extras_params(func)
    body = func.body
    if spec is not None and spec.qkv is not None:
        body = body.visit(QKVFusion(spec.qkv, ("", "", "", "")))
    body = body.visit(_InitRewrite(info, ctx))
    if plain_base:
        body = body.visit(_SuperInit())
    elif rebased_embedding:
        body = body.visit(_EmbeddingSuper())
    if spec is not None:
        lines = _attention_init_lines(spec, info.name in ctx.sharded_attention)
        block = cst.parse_statement(
            "if True:\n" + "\n".join("    " + line for line in lines) + "\n"
        )
        extra = list(block.body.body)
        body = body.with_changes(body=[*body.body, *extra])
    body = body.with_changes(body=[s for s in body.body if not _is_docstring(s)])
    return func.with_changes(body=body)


def _join_blocks(lines: list[str]) -> list[str]:
    """Group an `if` line with its indented body so each parses as one statement."""
    out: list[str] = []
    for line in lines:
        if line.startswith(" ") and out:
            out[-1] += "\n" + line
        else:
            out.append(line)
    return out


def _is_docstring(stmt) -> bool:
    return m.matches(
        stmt, m.SimpleStatementLine([m.Expr(m.SimpleString() | m.ConcatenatedString())])
    )


# --- q/k/v fused inside a faithful attention ---------------------------------------


class QKVFusion(cst.CSTTransformer):
    """A faithful attention whose q/k/v projections the QKV pattern proves: the three
    `nn.Linear` become one `QKVParallelLinear` (each rank its own heads of q, k and v,
    k and v replicated when there are fewer kv heads than ranks), and the three calls
    one GEMM split in three; everything around them stays as the source has it."""

    def __init__(self, spec, names: tuple[str, str, str, str]):
        self.spec = spec
        self.q, self.k, self.v = spec.projections
        self.qkv_name, self.parts = names[0], names[1:]
        self.done = False

    # __init__: the projections
    def leave_SimpleStatementLine(self, original, updated):
        if len(updated.body) != 1 or not m.matches(
            updated.body[0],
            m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))]),
        ):
            return updated
        attr = updated.body[0].targets[0].target.attr.value
        if attr in (self.k, self.v):
            return cst.RemoveFromParent()
        if attr != self.q:
            return updated
        s = self.spec
        hd = f"self.{s.head_dim_attr}"
        lines = [
            f"# Fused: {self.q} + {self.k} + {self.v} -> {s.merged}. Each rank holds its own heads",
            "# of q, k and v; with fewer kv heads than ranks, k and v are replicated.",
            f"self.{s.merged} = QKVParallelLinear({code(s.hidden_size)}, {hd}, {code(s.num_heads)}, "
            f"{code(s.num_kv_heads)}, bias={code(s.bias)}, quant_config=quant_config, "
            f'prefix=f"{{prefix}}.{s.merged}")',
            f"self.q_size = self.{s.merged}.num_heads * {hd}",
            f"self.kv_size = self.{s.merged}.num_kv_heads * {hd}",
        ]
        block = cst.parse_statement(
            "if True:\n" + "\n".join("    " + line for line in lines) + "\n"
        )
        return cst.FlattenSentinel(list(block.body.body))

    # forward: the calls
    def leave_IndentedBlock(self, original, updated):
        calls = {
            p: m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(p)))
            for p in self.spec.projections
        }
        body = list(updated.body)
        first = next(
            (
                i
                for i, stmt in enumerate(body)
                if any(m.findall(stmt, c) for c in calls.values())
            ),
            None,
        )
        if first is None or self.done:
            return updated
        found = [m.findall(cst.Module(body=body), c) for c in calls.values()]
        if any(len(f) != 1 for f in found):
            return updated
        arg = code(found[0][0].args[0].value)
        q, k, v = self.parts
        split = cst.parse_statement(
            f"{q}, {k}, {v} = self.{self.spec.merged}({arg})[0].split("
            "[self.q_size, self.kv_size, self.kv_size], dim=-1)\n"
        )
        names = dict(zip(self.spec.projections, self.parts))

        class _Swap(cst.CSTTransformer):
            def leave_Call(self, original, updated):
                for p, c in calls.items():
                    if m.matches(updated, c):
                        return cst.Name(names[p])
                return updated

        self.done = True
        body = [s.visit(_Swap()) for s in body]
        return updated.with_changes(body=[*body[:first], split, *body[first:]])


def fused_names(forward: cst.FunctionDef) -> tuple[str, str, str, str]:
    """Local names for the merged projection's parts that the forward does not use."""
    used = {n.value for n in m.findall(forward, m.Name())}
    for suffix in ("", "_", "_fused"):
        names = tuple(f"{n}{suffix}" for n in ("qkv", "q", "k", "v"))
        if not set(names) & used:
            return names
    return ("qkv_fused", "q_fused", "k_fused", "v_fused")
