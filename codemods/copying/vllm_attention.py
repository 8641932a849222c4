"""The attention-interface call of a copied attention -> vLLM's paged `Attention`.

The class keeps its own code; the call `attention_interface(self, q, k, v, mask, ...)`
becomes `vllm_attention(self.attn, q, k, v)` (transformers' [1, heads, tokens, size]
layout around vLLM's [tokens, heads * size]), and `__init__` builds the `Attention`
with what `attention.infer` read from the source (heads, scale, window, soft-cap,
sinks, ALiBi slopes, chunks)."""

from __future__ import annotations

import re

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import code

from .attention import AttentionSpec

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


def tp_size_line(taken: str = "") -> str:
    """`tp_size`: the ranks a class's heads and widths split over; 1 for a config that
    does not take the branches its sharding is proven on (`taken`)."""
    if not taken:
        return "tp_size = get_tensor_model_parallel_world_size()"
    return f"tp_size = get_tensor_model_parallel_world_size() if {taken} else 1"


def _reads_divided(expr: str, head_attrs: list[str]) -> bool:
    """Whether `expr` is more than one head attribute and reads one."""
    read = set(re.findall(r"\bself\.(\w+)", expr))
    return bool(read & set(head_attrs)) and expr[5:] not in head_attrs


def init_lines(
    spec: AttentionSpec,
    sharded: bool,
    attention_name: str,
    merged_heads: tuple[str, str] | None,
    replicated_kv: bool = False,
    taken: str = "",
) -> list[str]:
    """What `__init__` gains: this rank's head counts, the sinks' loader, the `Attention`.
    `replicated_kv`: q/k/v in one QKVParallelLinear, whose ranks beyond the kv heads'
    count each hold a replica of one; `taken`: the config branches the sharding is
    proven on."""
    heads, kv = spec.heads, spec.kv_heads
    lines = []
    if merged_heads is not None:
        # this rank's heads, as the merged projection holds them
        heads, kv = merged_heads
        fitted = [
            f"self.{a} = {kv if a in spec.kv_head_attrs else heads}"
            for a in spec.head_attrs
        ]
        if fitted:
            lines += ["# the source's reshapes count this rank's heads", *fitted]
    elif sharded:
        if replicated_kv:
            lines += [
                "# tensor parallel: this rank holds its share of the query heads and of the",
                "# kv heads, or one kv head replicated where the ranks outnumber them (as",
                "# QKVParallelLinear holds them; the source's reshapes count heads per rank)",
                tp_size_line(taken),
            ]
        else:
            lines += [
                "# tensor parallel: q/k/v are column-parallel, so this rank holds its share",
                "# of the heads (the source's reshapes count heads per rank)",
                tp_size_line(taken),
                f"assert ({spec.kv_heads}) % tp_size == 0, "
                '"the kv heads must divide over the tensor-parallel ranks"',
            ]
        # an expression reading head counts the lines below divide (Falcon's `self.num_heads
        # if self.new_decoder_architecture else self.num_kv_heads`): read before them
        if _reads_divided(kv, spec.head_attrs):
            lines.append(f"total_kv_heads = {kv}")
            kv = "total_kv_heads"

        def share(count: str, of_kv: bool) -> str:
            if of_kv and replicated_kv:  # at least the one replica
                return f"max(1, {count} // tp_size)"
            return f"{count} // tp_size"

        for attr in spec.head_attrs:
            lines.append(
                f"self.{attr} = {share(f'self.{attr}', attr in spec.kv_head_attrs)}"
            )
        if not heads.startswith("self.") or heads[5:] not in spec.head_attrs:
            heads = share(heads, False)
        if not kv.startswith("self.") or kv[5:] not in spec.head_attrs:
            kv = share(kv, True)
    if spec.sinks and (sharded or merged_heads is not None):
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
        if sharded:  # this rank's heads' slopes, of the slopes of all heads
            rank = "get_tensor_model_parallel_rank()"
            every = _all_heads(slopes, spec.head_attrs)
            slopes = f"{every}[{rank} * ({heads}) : ({rank} + 1) * ({heads})]"
        args.append(f"alibi_slopes={slopes}")
    args.append(f'prefix=f"{{prefix}}.{spec.attr}"')
    full = f"self.{spec.attr} = {attention_name}({', '.join(args)})"
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


def _all_heads(expr: str, head_attrs: list[str]) -> str:
    """`expr` read after the lines above divided the head counts over the ranks: each
    `self.<head count>` in it multiplied back (ALiBi's slopes depend on the total)."""

    class Whole(cst.CSTTransformer):
        def leave_Attribute(self, original, updated):
            if (
                m.matches(updated.value, m.Name("self"))
                and updated.attr.value in head_attrs
            ):
                return cst.parse_expression(f"(self.{updated.attr.value} * tp_size)")
            return updated

        def leave_Arg(self, original, updated):  # a call's own parentheses suffice
            if isinstance(updated.value, cst.BinaryOperation):
                return updated.with_changes(
                    value=updated.value.with_changes(lpar=[], rpar=[])
                )
            return updated

    return code(cst.parse_expression(expr).visit(Whole()))


class InterfaceCall(cst.CSTTransformer):
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
