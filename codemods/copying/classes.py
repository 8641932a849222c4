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

from fusion_patterns.base import (
    CLASS,
    LINEARS,
    branch_keys,
    Claim,
    ClassInfo,
    code,
    dotted_name,
    linear_args,
    with_positions_param,
)
from fusion_patterns.emitting import with_keyword
from fusion_patterns.sharding import PACKED, QKV

from ..errors import CodemodError
from ..attention_calls import interface_name
from . import merged_linears, vllm_attention
from .attention import AttentionSpec
from .config_branches import BranchRead, negated
from .definitions import strip_decorators
from .eager_attention import CoreRewrite
from .inference import clean_signature, inference_folded, is_docstring

# transformers' `Conv1D(nf, nx)` (GPT-2): a linear storing its weight [in, out]
CONV1D = "Conv1D"
CONV1D_HELPER = '''
def conv1d_layout(layer: nn.Module) -> nn.Module:
    """transformers' `Conv1D` is a linear that stores its weight as [in, out]: vLLM's
    linear loads the checkpoint's tensor transposed."""
    load = layer.weight.weight_loader
    layer.weight.weight_loader = lambda param, weight, *args: load(param, weight.t(), *args)
    return layer
'''
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


@dataclass
class Context:
    """What the rewrite of every class needs to know about the others."""

    classes: dict[str, ClassInfo]
    # claimed classes whose every construction is the pattern's (proven norms)
    constructions: dict[str, Claim]
    prefix_classes: set[str]  # classes built with quant_config/prefix
    attention: dict[str, AttentionSpec]  # copied attentions -> their vLLM Attention
    # class -> attr -> TP style; a linear not in here is replicated
    styles: dict[str, dict[str, str]] = field(default_factory=dict)
    # class -> its attributes counting a sharded width (`self.embed_dim`), divided
    # over the TP ranks at the end of `__init__`
    divided: dict[str, list[str]] = field(default_factory=dict)
    # class -> the config branches its sharding is proven on (`(config.multi_query)`):
    # its linears and head counts split where a config takes them, whole elsewhere
    tp_conditions: dict[str, str] = field(default_factory=dict)
    # class -> {linear: the out_features expressions building the [q; k; v] proven}
    qkv_outputs: dict[str, dict[str, set[str]]] = field(default_factory=dict)
    # class -> its two linears on one tensor, merged (`merged_linears.Merge`)
    merges: dict = field(default_factory=dict)
    # linear attributes read as `.weight`/`.bias`: kept as nn.Linear
    kept_linears: set[str] = field(default_factory=set)
    # class -> the linears it reads as weights on a branch its config decides
    branch_reads: dict[str, BranchRead] = field(default_factory=dict)
    # class -> attrs whose head count is divided over the TP ranks
    sharded_attention: set[str] = field(default_factory=set)
    # functions of the source that build attention masks (their calls become None)
    mask_functions: set[str] = field(default_factory=set)
    # (class, attr) -> the source class the tiny model built there, for constructions
    # through a lookup (`CLASSES[config._attn_implementation](config)`)
    built: dict[tuple[str, str], str] = field(default_factory=dict)
    # (class, attr) -> the class table it is built from per layer
    tables: dict = field(default_factory=dict)
    # vLLM's Attention under the name the file imports it as (VllmAttention where the
    # source defines a class of its own called Attention)
    attention_name: str = "Attention"
    # class -> expressions of this rank's (query, kv) head counts after a claim merged
    # its projections
    merged_heads: dict[str, tuple[str, str]] = field(default_factory=dict)
    # claimed classes a copied caller calls the pattern's way (vLLM's positions handed
    # by the pattern's call too, where the claim is CLASS)
    call_sites: dict[str, Claim] = field(default_factory=dict)
    # classes whose forward takes vLLM's positions (to hand them to a claimed module)
    positions: set[str] = field(default_factory=set)
    # subclasses of nn.Linear proven to compute it: built as `nn.Linear` is
    linear_classes: set[str] = field(default_factory=set)


def is_pretrained(node: cst.ClassDef, classes) -> bool:
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


def builds_vllm_layers(info: ClassInfo, classes, fused: set[str], attention) -> bool:
    if info.name in fused or info.name in attention:
        return True
    return bool(
        info.init
        and (
            m.findall(info.init, m.Call(func=_LINEAR_FUNC))
            or (
                CONV1D not in classes  # transformers' Conv1D: a vLLM linear here
                and m.findall(info.init, m.Call(func=m.Name(CONV1D)))
            )
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


def _class_aliases(info: ClassInfo) -> dict[str, list[str]]:
    """Locals of `__init__` naming one of several classes by a condition
    (`ffn_layer_class = JambaSparseMoeBlock if num_experts > 1 else JambaMLP`)."""

    def names(value) -> list[str] | None:
        if isinstance(value, cst.Name):
            return [value.value]
        if isinstance(value, cst.IfExp):
            body, orelse = names(value.body), names(value.orelse)
            return body + orelse if body and orelse else None
        return None

    out = {}
    if info.init is not None:
        for a in m.findall(info.init, m.Assign(targets=[m.AssignTarget(m.Name())])):
            found = names(a.value)
            if found and isinstance(a.value, cst.IfExp):
                out[a.targets[0].target.value] = found
    return out


def prefix_classes(
    classes: dict[str, ClassInfo],
    wanted: set[str],
    fused: set[str],
    attention,
    looked_up: dict | None = None,
) -> set[str]:
    """Classes that hold vLLM layers, directly or through the classes they build: they
    take `quant_config` and `prefix`, and every construction of them passes both."""
    out = {
        n for n in wanted if builds_vllm_layers(classes[n], classes, fused, attention)
    }
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
        self.aliases = _class_aliases(info)

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
        table = self.ctx.tables.get((self.info.name, path or ""))
        if table is not None and isinstance(updated.func, cst.Subscript):
            # one class per layer, chosen by the table's key: each built as the copy
            # builds it (a claimed one the pattern's way), the choice kept
            built = {
                k: code(
                    self.leave_Call(original, updated.with_changes(func=cst.Name(c)))
                )
                for k, c in table.classes.items()
            }
            entries = ", ".join(f"{k!r}: lambda: {v}" for k, v in built.items())
            return cst.parse_expression(
                f"{{{entries}}}[{code(updated.func.slice[0].slice.value)}]()"
            )
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
        if func in self.ctx.linear_classes:  # proven to compute what nn.Linear does
            func = "nn.Linear"
            updated = updated.with_changes(func=cst.parse_expression(func))
        if func in LINEARS:
            return self._linear(updated, path)
        if func == CONV1D and CONV1D not in self.ctx.classes:
            return self._linear(updated, path, conv1d=True)
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
        if func in self.ctx.constructions:
            claim = self.ctx.constructions[func]
            return cst.parse_expression(
                claim.pattern.construction(claim, updated, path)
            )
        # the source's classes it may name (`None` on a branch that builds nothing)
        alts = [c for c in self.aliases.get(func, []) if c in self.ctx.classes]
        if (
            alts
            and path is not None
            and any(c in self.ctx.prefix_classes for c in alts)
        ):
            # `cls = MoeBlock if n > 1 else MLP; self.ffn = cls(config)` (Jamba): a
            # local naming copied classes, built with vLLM's arguments like them
            if not all(c in self.ctx.prefix_classes for c in alts):
                raise CodemodError(
                    f"cannot generate: {self.info.name} builds self.{path} from "
                    f"`{func}`, which names {' or '.join(alts)}, of which only some "
                    "hold vLLM layers"
                )
            func = alts[0]
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

    def _linear(
        self, call: cst.Call, path: str | None, conv1d: bool = False
    ) -> cst.BaseExpression:
        attr = path if path and "." not in path else None
        keywords = {a.keyword.value for a in call.args if a.keyword is not None}
        positional = [a.value for a in call.args if a.keyword is None]
        if (
            (keywords - {"in_features", "out_features", "bias"})
            or (conv1d and (keywords or len(positional) != 2))
            or (attr or "") in self.ctx.kept_linears
            or path is None
        ):
            return call  # device/dtype arguments or read as a weight: plain torch
        if conv1d:  # Conv1D(nf, nx): nx inputs, nf outputs, a bias
            out_size, in_size = positional
            bias = cst.Name("True")
        else:
            in_size, out_size, bias = linear_args(call)
        merge = self.ctx.merges.get(self.info.name)
        if merge is not None and attr == merge.parts[0] and not conv1d:
            taken = self.ctx.tp_conditions.get(self.info.name)
            return cst.parse_expression(
                merged_linears.construction(
                    merge, call, negated(taken) if taken else None
                )
            )
        style = self.ctx.styles.get(self.info.name, {}).get(attr or "", "replicate")
        outs = code(out_size)
        part = _part(out_size, style)
        spec = self.ctx.attention.get(self.info.name)
        if part is not None:  # `3 * width` split in three: vLLM's merged linear
            cls, extra = "MergedColumnParallelLinear", ""
            outs = f"[{part}] * {style.removeprefix(PACKED)}"
        elif (
            style == QKV
            and spec is not None
            and outs in self.ctx.qkv_outputs.get(self.info.name, {}).get(attr, ())
        ):  # [q; k; v]: the query heads split, the kv heads split or replicated
            cls, extra = "QKVParallelLinear", ""
            outs = f"{spec.head_size}, {spec.heads}, {spec.kv_heads}"
        else:  # another construction of a packed attr than the one proven: whole
            style = "replicate" if style.startswith(PACKED) or style == QKV else style
            cls, extra = STYLES.get(style, STYLES["replicate"])
        taken = self.ctx.tp_conditions.get(self.info.name)
        if style != "replicate" and taken:  # proven on the config branches it takes
            extra += f"disable_tp={negated(taken)}, "
        text = (
            f"{cls}({code(in_size)}, {outs}, bias={code(bias)}, {extra}"
            f'quant_config=quant_config, prefix=f"{{prefix}}.{path}", return_bias=False)'
        )
        if conv1d:
            text = f"conv1d_layout({text})"
        branch = self.ctx.branch_reads.get(self.info.name)
        if branch is not None and attr in branch.attrs:
            # a config taking the branch that reads its weight: the source's own layer
            text = f"({code(call)} if {branch.init_test} else {text})"
        return cst.parse_expression(text)


def _part(out_size: cst.BaseExpression, style: str) -> str | None:
    """`width` of a packed linear's `N * width` outputs, N its parts; else None."""
    if not style.startswith(PACKED):
        return None
    parts = style.removeprefix(PACKED)
    if isinstance(out_size, cst.BinaryOperation) and isinstance(
        out_size.operator, cst.Multiply
    ):
        for count, width in (
            (out_size.left, out_size.right),
            (out_size.right, out_size.left),
        ):
            if isinstance(count, cst.Integer) and count.value == parts:
                return code(width)
    return None


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


def rewrite_class(
    info: ClassInfo, ctx: Context, base: str | None = None, claims: tuple = ()
) -> str:
    """The class, copied with vLLM's layers in; `base` replaces its bases if given.
    `claims` (patterns' rewrites of parts of this class) apply to the source first."""
    node = strip_decorators(info.node)
    for claim in claims:
        node = claim.pattern.rewrite_class(claim, node)
    merge = ctx.merges.get(info.name)
    # (a visit rebuilds every node: only where there is something to change, since the
    # eager-attention rewrite finds its statements by identity)
    if any(
        c in ctx.call_sites
        for a in _called_attrs(node)
        for c in _called_classes(info, ctx, a)
    ) or any(
        info.list_element_class(a, ctx.classes) in ctx.call_sites
        for a in _indexed(node)
    ):
        node = node.visit(_ClaimedCalls(info, ctx)).visit(_NoneUnpacked())
    if info.name in ctx.positions:
        node = node.visit(_Positions(info, ctx))
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
                if merge is not None:
                    stmt = stmt.visit(merged_linears.InitTargets(merge))
            else:
                if spec is not None and stmt.name.value == "forward":
                    if spec.eager is not None:
                        stmt = stmt.visit(CoreRewrite(spec))
                    else:
                        name = interface_name(info.forward)
                        stmt = stmt.visit(vllm_attention.InterfaceCall(name, spec.attr))
                stmt = inference_folded(stmt)
                if merge is not None and stmt.name.value == "forward":
                    # last: the attention rewrite above finds statements by identity
                    stmt = merged_linears.split_forward(stmt, merge)
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
    body = func.body.visit(_InitRewrite(info, ctx))
    if plain_base:
        body = body.visit(_SuperInit())
    elif rebased_embedding:
        body = body.visit(_EmbeddingSuper())
    if spec is not None:
        lines = vllm_attention.init_lines(
            spec,
            info.name in ctx.sharded_attention,
            ctx.attention_name,
            ctx.merged_heads.get(info.name),
            replicated_kv=QKV in ctx.styles.get(info.name, {}).values(),
            taken=ctx.tp_conditions.get(info.name, ""),
        )
        body = _append(body, lines)
    if info.name in ctx.branch_reads:
        body = _append(body, ctx.branch_reads[info.name].guard_lines())
    if ctx.divided.get(info.name):
        # a sharded attention's lines above have set `tp_size` already
        has_tp_size = (
            spec is not None
            and info.name in ctx.sharded_attention
            and info.name not in ctx.merged_heads
        )
        body = _append(
            body,
            [
                "# tensor parallel: the source's reshapes count this rank's width",
                *(
                    []
                    if has_tp_size
                    else [
                        vllm_attention.tp_size_line(
                            ctx.tp_conditions.get(info.name, "")
                        )
                    ]
                ),
                *(f"self.{a} = self.{a} // tp_size" for a in ctx.divided[info.name]),
            ],
        )
    body = body.with_changes(body=[s for s in body.body if not is_docstring(s)])
    return func.with_changes(body=body)


def _append(body: cst.IndentedBlock, lines: list[str]) -> cst.IndentedBlock:
    block = cst.parse_statement(
        "if True:\n" + "\n".join("    " + line for line in lines) + "\n"
    )
    return body.with_changes(body=[*body.body, *block.body.body])


def _called_attrs(node: cst.ClassDef) -> set[str]:
    return {
        c.func.attr.value
        for c in m.findall(node, m.Call(func=m.Attribute(value=m.Name("self"))))
    }


_SELF = m.Attribute(value=m.Name("self"))


def _indexed(node: cst.ClassDef) -> set[str]:
    """Attributes called by index: `self.<attr>[i](...)`."""
    return {
        c.func.value.attr.value
        for c in m.findall(node, m.Call(func=m.Subscript(value=_SELF)))
    }


def _called_class(
    info: ClassInfo, ctx: Context, attr: str, branch: tuple[str, str] | None = None
) -> str | None:
    """The source class `self.<attr>` is built from (through a lookup too); for one
    built from a class table, the class of the `if <key> == "<value>":` branch the
    call is in, else none."""
    table = ctx.tables.get((info.name, attr))
    if table is not None:
        return table.class_at(branch)
    return ctx.built.get((info.name, attr)) or info.constructed_class(attr)


def _called_classes(info: ClassInfo, ctx: Context, attr: str) -> set[str | None]:
    table = ctx.tables.get((info.name, attr))
    if table is not None:
        return set(table.classes.values())
    return {_called_class(info, ctx, attr)}


class _CallsByClass(cst.CSTTransformer):
    """A transform of `self.<attr>(...)` calls by the source class each reaches (for
    an attribute built from a class table, by the branch the call is in)."""

    def __init__(self, info: ClassInfo, ctx: Context):
        self.info, self.ctx = info, ctx
        self.branches: dict = {}

    def visit_ClassDef(self, node: cst.ClassDef):
        self.branches = branch_keys(node)

    def called_class(self, original: cst.Call) -> str | None:
        if isinstance(original.func, cst.Subscript):  # `self.<attr>[i](...)`
            return self.info.list_element_class(
                original.func.value.attr.value, self.ctx.classes
            )
        return _called_class(
            self.info,
            self.ctx,
            original.func.attr.value,
            self.branches.get(id(original)),
        )


class _ClaimedCalls(_CallsByClass):
    """`self.<attr>(...)` of a module a pattern claimed whole -> the call the pattern
    says (vLLM's interface: `self.self_attn(positions, hidden_states)`); `self.<attr>[i]
    (...)` too where the attribute is a module list of that class alone (LongCat's two
    attentions per layer)."""

    def leave_Call(self, original, updated: cst.Call):
        if not m.matches(updated.func, _SELF | m.Subscript(value=_SELF)):
            return updated
        claim = self.ctx.call_sites.get(self.called_class(original) or "")
        if claim is None:
            return updated
        replaced = claim.pattern.call_site(claim, updated)
        return updated if replaced is None else replaced


class _NoneUnpacked(cst.CSTTransformer):
    """`h, _ = (call, None)` (a claimed module returns one tensor where the source's
    returned more) -> `h = call`."""

    def leave_SimpleStatementLine(self, original, updated):
        if len(updated.body) != 1 or not m.matches(
            updated.body[0],
            m.Assign(targets=[m.AssignTarget(m.Tuple())], value=m.Tuple()),
        ):
            return updated
        assign = updated.body[0]
        targets = [e.value for e in assign.targets[0].target.elements]
        values = [e.value for e in assign.value.elements]
        if len(targets) != len(values) or not all(
            m.matches(v, m.Name("None")) for v in values[1:]
        ):
            return updated
        lines = [cst.Assign([cst.AssignTarget(targets[0])], values[0])]
        lines += [
            cst.Assign([cst.AssignTarget(t)], cst.Name("None"))
            for t in targets[1:]
            if not m.matches(t, m.Name("_"))
        ]
        return cst.FlattenSentinel(
            [
                updated.with_changes(
                    body=[line], leading_lines=() if i else updated.leading_lines
                )
                for i, line in enumerate(lines)
            ]
        )


class _Positions(_CallsByClass):
    """vLLM's positions, handed down: `forward` takes `positions`, and each copied
    module below that needs them is called with `positions=positions`."""

    def leave_FunctionDef(self, original, updated: cst.FunctionDef):
        if updated.name.value != "forward":
            return updated
        return with_positions_param(updated)

    def leave_Call(self, original, updated: cst.Call):
        if not m.matches(updated.func, m.Attribute(value=m.Name("self"))):
            return updated
        cls = self.called_class(original)
        if cls not in self.ctx.positions:
            return updated
        claim = self.ctx.call_sites.get(cls)
        if claim is not None and claim.kind == CLASS:
            return updated
        if any(
            a.keyword is not None and a.keyword.value == "positions"
            for a in updated.args
        ):
            return updated
        return with_keyword(updated, "positions", "positions")
