"""Two linears a copied class calls on one tensor -> one `MergedColumnParallelLinear`,
the merge vLLM's own MLPs make, where the gated-MLP pattern refused the class as a
whole (Gemma 3n's activation sparsity between the gate and its activation, BitNet's
norm before the down projection): one GEMM split in two, everything around the two
calls kept as the source has it.

Both linears must shard alike in the copy's plan: column-parallel (each rank its share
of each part, as the merged layer holds them; `disable_tp=` where the class is whole
on some ways or layers) or whole on every rank (`disable_tp=True`). Proven on the tiny
instance: the two read one tensor. A record says it, and the loader stacks the two
checkpoint tensors as the merged layer's shards 0 and 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import (
    LINEARS,
    FusionRecord,
    code,
    dotted_name,
    linear_args,
    self_attr,
)
from fusion_patterns.qkv.match import merged_name

VLLM_CLASS = "MergedColumnParallelLinear"
# the copy's styles a merged layer holds: sharded by parts, or whole
MERGEABLE = ("colwise", "replicate")


@dataclass(frozen=True)
class Merge:
    cls: str
    parts: tuple[str, str]  # in the order `__init__` builds them: shards 0 and 1
    merged: str
    second_out: str  # the second part's output size, as `__init__` writes it
    style: str  # the copy's style for both parts


def find(info, excluded: set[str]) -> tuple[tuple[str, str], str] | None:
    """((first, second), the second's output size) for the one pair of linears built
    as `self.<a> = nn.Linear(...)` at the top of `__init__` and each called once in
    forward, both on one name no statement between the calls reassigns, with one input
    size and one bias; None where there is no such pair (or more than one)."""
    if info.forward is None or info.init is None:
        return None
    built = {}
    for stmt in info.init.body.body:
        assign = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) else None
        if (
            isinstance(assign, cst.Assign)
            and len(assign.targets) == 1
            and m.matches(assign.targets[0].target, self_attr())
            and isinstance(assign.value, cst.Call)
            and dotted_name(assign.value.func) in (*LINEARS, "Linear")
        ):
            built[assign.targets[0].target.attr.value] = assign.value
    inputs: dict[str, list[str]] = {}
    for attr in [a for a in built if a not in excluded]:
        calls = m.findall(info.forward, m.Call(func=self_attr(attr)))
        if len(calls) == 1 and m.matches(calls[0], m.Call(args=[m.Arg(m.Name())])):
            inputs.setdefault(calls[0].args[0].value.value, []).append(attr)
    pairs = [(x, attrs) for x, attrs in inputs.items() if len(attrs) == 2]
    if len(pairs) != 1:
        return None
    x, (first, second) = pairs[0]
    (in1, _, bias1), (in2, out2, bias2) = (linear_args(built[a]) for a in pairs[0][1])
    if code(in1) != code(in2) or code(bias1) != code(bias2):
        return None
    body = list(info.forward.body.body)
    at = [_statement_of(body, a) for a in (first, second)]
    if None in at or _assigns(body[min(at) : max(at)], x):
        return None
    return (first, second), code(out2)


def _statement_of(body: list, attr: str) -> int | None:
    """The index of the top-level statement of forward calling `self.<attr>`."""
    for i, stmt in enumerate(body):
        if m.findall(stmt, m.Call(func=self_attr(attr))):
            return i
    return None


def _assigns(statements: list, name: str) -> bool:
    target = m.AssignTarget(target=m.Name(name))
    return any(
        m.findall(s, m.Assign(targets=[m.ZeroOrMore(), target, m.ZeroOrMore()]))
        or m.findall(s, m.AugAssign(target=m.Name(name)))
        or m.findall(s, m.AnnAssign(target=m.Name(name)))
        for s in statements
    )


def read_one_tensor(instance, call, parts: tuple[str, str]) -> bool:
    """Whether the two linears of `instance` read one tensor when it is run on the
    tiny model's call."""
    import torch

    seen: dict[str, torch.Tensor] = {}
    hooks = [
        getattr(instance, a).register_forward_hook(
            lambda mod, args, out, a=a: seen.__setitem__(a, args[0])
        )
        for a in parts
    ]
    try:
        args, kwargs, _ = call
        with torch.no_grad():
            instance(*args, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    if set(seen) != set(parts):
        return False
    first, second = (seen[a] for a in parts)
    return first.shape == second.shape and torch.equal(first, second)


def plan(model, styles: dict[str, dict[str, str]], claimed) -> list[Merge]:
    """The merges of the copied classes: `styles`, the copy's; `claimed(cls)`, the
    attributes of `cls` a pattern's claim has taken."""
    out = []
    for n in model.roles.wanted:
        info = model.classes.get(n)
        inst = model.first(n)
        call = model.call(inst) if inst is not None else None
        if info is None or call is None:
            continue
        reads = model.branch_reads.get(n)
        kept = set(reads.attrs) if reads is not None else set()
        found = find(info, kept | model.kept_linears | claimed(n))
        if found is None:
            continue
        parts, second_out = found
        style = {styles.get(n, {}).get(a, "replicate") for a in parts}
        if len(style) != 1 or not style <= set(MERGEABLE):
            continue
        try:
            same = read_one_tensor(inst, call, parts)
        except Exception:  # noqa: BLE001 - a module the probe's call cannot rerun
            same = False
        if same:
            merged = merged_name(parts, sep="_")
            out.append(Merge(n, parts, merged, second_out, style.pop()))
    return out


def records(merge: Merge, scopes: list[str]) -> list[FusionRecord]:
    return [
        FusionRecord(
            "merged linears",
            merge.cls,
            merge.parts,
            merge.merged,
            VLLM_CLASS,
            (0, 1),
            scope,
            detail="" if merge.style == "colwise" else "whole on every rank",
        )
        for scope in scopes
    ]


def construction(merge: Merge, call: cst.Call, disable_tp: str | None) -> str:
    """The merged layer built where the source builds the first part (`call`)."""
    in_size, out_size, bias = linear_args(call)
    if merge.style == "replicate":
        disable_tp = "True"
    extra = f"disable_tp={disable_tp}, " if disable_tp else ""
    return (
        f"{VLLM_CLASS}({code(in_size)}, [{code(out_size)}, {merge.second_out}], "
        f"bias={code(bias)}, {extra}quant_config=quant_config, "
        f'prefix=f"{{prefix}}.{merge.merged}", return_bias=False)'
    )


class InitTargets(cst.CSTTransformer):
    """`__init__` after the copy: the first part's statement assigns the merged layer,
    the second part's is gone."""

    def __init__(self, merge: Merge):
        self.merge = merge

    def leave_SimpleStatementLine(self, original, updated):
        first, second = self.merge.parts
        for attr, action in ((first, "rename"), (second, "drop")):
            target = m.AssignTarget(target=self_attr(attr))
            if m.matches(updated, m.SimpleStatementLine(body=[m.Assign([target])])):
                if action == "drop":
                    return cst.RemoveFromParent()
                assign = updated.body[0]
                renamed = assign.targets[0].with_changes(
                    target=cst.parse_expression(f"self.{self.merge.merged}")
                )
                return updated.with_changes(
                    body=[assign.with_changes(targets=[renamed])]
                )
        return updated


def split_forward(forward: cst.FunctionDef, merge: Merge) -> cst.FunctionDef:
    """The two calls one GEMM, split by this rank's sizes of the parts."""
    used = {n.value for n in m.findall(forward, m.Name())}
    names = []
    for attr in merge.parts:
        name = f"{attr}_out"
        while name in used:
            name += "_"
        names.append(name)
    body = list(forward.body.body)
    at = min(_statement_of(body, a) for a in merge.parts)
    call = m.findall(forward, m.Call(func=self_attr(merge.parts[0])))[0]
    x = code(call.args[0].value)
    split = cst.parse_statement(
        f"{names[0]}, {names[1]} = self.{merge.merged}({x}).split("
        f"self.{merge.merged}.output_partition_sizes, dim=-1)\n"
    )

    class _Swap(cst.CSTTransformer):
        def leave_Call(self, original, updated):
            for attr, name in zip(merge.parts, names):
                if m.matches(updated, m.Call(func=self_attr(attr))):
                    return cst.Name(name)
            return updated

    body = [s.visit(_Swap()) for s in body]
    body.insert(at, split)
    return forward.with_changes(body=forward.body.with_changes(body=body))
