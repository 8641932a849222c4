"""A copied attention's one linear holding [q; k; v] with fewer kv heads than query
heads (GPTBigCode's multi-query `c_attn`: the query's heads, then one key head and one
value head): built as vLLM's QKVParallelLinear, which splits the query heads over the
ranks and gives each rank its kv heads' share, or a replica of one where the ranks
outnumber them (`sharding.QKV`, proven by the class's sharding proof).

Only the construction the tiny model built is one: another construction of the same
attribute (a cross-attention's `c_attn` of keys and values only) stays whole; and the
sharding holds on the config branches the tiny model took (`config.multi_query`): a
config taking another runs the class whole on every rank.
"""

from __future__ import annotations

import libcst.matchers as m

from fusion_patterns.base import (
    LINEARS,
    ClassInfo,
    FusionRecord,
    code,
    dotted_name,
    linear_args,
)
from fusion_patterns.sharding import RANKS, qkv_layout


def built_outputs(info: ClassInfo, attr: str, instance) -> set[str]:
    """The `out_features` expressions of `self.<attr> = nn.Linear(...)` in `info`'s
    `__init__` whose value on `instance` is the width it built."""
    built = getattr(instance, attr).out_features
    out: set[str] = set()
    if info.init is None:
        return out
    for node in m.findall(info.init, m.Assign(value=m.Call())):
        if dotted_name(node.value.func) not in LINEARS or not any(
            m.matches(t.target, m.Attribute(value=m.Name("self"), attr=m.Name(attr)))
            for t in node.targets
        ):
            continue
        text = code(linear_args(node.value)[1])
        try:
            value = eval(text, {"self": instance})  # noqa: S307 - source expressions
        except Exception:  # noqa: BLE001 - reads a local: not known to be this one
            continue
        if value == built:
            out.add(text)
    return out


def record(cls: str, attr: str, instance, spec, taken: str) -> FusionRecord:
    heads, kv_heads, _ = qkv_layout(instance, attr, spec.head_attrs, spec.kv_head_attrs)
    kv = (
        f"its {kv_heads} kv heads split"
        if kv_heads % RANKS == 0
        else f"{'its' if kv_heads > 1 else 'its one'} kv head replicated on each rank"
    )
    where = f"; whole on every rank where not `{taken}`" if taken else ""
    return FusionRecord(
        pattern="tensor parallel",
        source_class=cls,
        sources=(attr,),
        target=attr,
        vllm_class="QKVParallelLinear",
        packed=(
            f"q|k|v packed in the checkpoint: its {heads} query heads split over the "
            f"ranks, {kv}{where}"
        ),
    )
