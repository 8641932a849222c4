"""q/k/v of a copied attention -> one `QKVParallelLinear` (a rewrite of the copy).

Where the whole attention cannot be vLLM's own (`native.py`), the copied class still
merges its three projections when the match and the proofs hold: the three
`nn.Linear` become one `QKVParallelLinear` (each rank its own heads of q, k and v; k
and v replicated when there are fewer kv heads than ranks), the three calls one GEMM
split in three, and everything around them stays as the source has it. The merged
layer shards by heads, as the class does: transformers' TP plan for it, or q/k/v
column- and the output row-parallel, proven over two simulated ranks on each way its
config branches go. Where that fails on some ways the layer is whole on every rank
there (`disable_tp=<those ways>`), where it fails on all, everywhere: one GEMM for
three all the same, the class replicated and said so.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ..base import REWRITE, Claim, Pattern, PatternRefused, Refusal, code
from ..sharding import prove as prove_sharded
from . import proof
from .match import NAME, match, records

WHAT = "q/k/v projections"


class QKVMerge(Pattern):
    name = NAME

    def claim(self, model):
        head_norms = model.norm_classes()
        for n, attention in model.roles.attention.items():
            if attention.eager is not None or model.claimed_whole(n):
                continue
            found = match(model.classes[n], head_norms, lenient=True)
            concrete = None
            if isinstance(found, Refusal):
                # read again as the copy runs it: a cross-attention's cached keys
                # (BioGPT's second `key_states = ...`) are gone there
                folded = match(model.folded(n), head_norms, lenient=True)
                if isinstance(folded, Refusal) or folded is None:
                    yield found
                    continue
                found, concrete = folded, model.inference_args(n)
            if (
                found is None
                or found.packed
                or set(found.projections) & model.kept_linears
            ):
                continue
            inst = model.first(n)
            try:
                proof.prove_dataflow(found, inst, concrete)
                proof.prove_merged_gemm(found, inst, model.config)
            except PatternRefused as why:
                yield Refusal(NAME, n, WHAT, str(why))
                continue
            except Exception as exc:  # a proof that cannot run is a refusal
                yield Refusal(NAME, n, WHAT, f"proof failed to run: {_first_line(exc)}")
                continue
            styles = model.tp_plan.get(n) or {
                **{p: "colwise" for p in found.projections},
                found.out_proj: "rowwise",
            }
            if not all(styles.get(p) == "colwise" for p in found.projections):
                why = "transformers' TP plan does not shard them column-parallel"
                yield Refusal(NAME, n, WHAT, f"the merged layer shards by heads: {why}")
                continue

            def sharded(instance, call, styles=styles):
                return prove_sharded(
                    instance, styles, attention.head_attrs, call, attention.sinks
                )

            # the merged layer shards by heads where the class does (on every way of
            # its config branches, or some), and is whole on every rank elsewhere
            ways = model.sharded_ways(
                n,
                (inst, model.call(inst)),
                styles,
                lambda other: sharded(other.instance, other.call),
                tiny_failure=sharded(inst, model.call(inst)),
            )
            if ways.where is None:
                styles = {a: "replicate" for a in styles}
            yield Claim(
                self,
                n,
                found,
                REWRITE,
                records=[
                    records(found, scope, set())[0]
                    for scope in model.roles.scopes.get(n, [""])
                ],
                styles=styles,
                sharded=ways,
                heads=(
                    f"self.{found.merged}.num_heads",
                    f"self.{found.merged}.num_kv_heads",
                ),
            )

    def rewrite_class(self, claim: Claim, node: cst.ClassDef) -> cst.ClassDef:
        spec = claim.spec
        body = []
        for stmt in node.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                fusion = QKVFusion(spec, ("", "", "", ""), claim.sharded)
                stmt = stmt.with_changes(body=stmt.body.visit(fusion))
            elif isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                stmt = stmt.visit(QKVFusion(spec, fused_names(stmt)))
            body.append(stmt)
        return node.with_changes(body=node.body.with_changes(body=body))


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


class QKVFusion(cst.CSTTransformer):
    """A faithful attention whose q/k/v projections the QKV pattern proves: the three
    `nn.Linear` become one `QKVParallelLinear` (each rank its own heads of q, k and v,
    k and v replicated when there are fewer kv heads than ranks), and the three calls
    one GEMM split in three; everything around them stays as the source has it."""

    def __init__(self, spec, names: tuple[str, str, str, str], sharded=None):
        self.spec = spec
        # `disable_tp=` where the class is whole on some or every rank's config
        self.disable_tp = sharded.disable_tp if sharded is not None else None
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
        disable_tp = f"disable_tp={self.disable_tp}, " if self.disable_tp else ""
        if self.disable_tp == "True":
            said = [
                f"# Fused: {self.q} + {self.k} + {self.v} -> {s.merged}: one GEMM, whole on every",
                "# rank (the class does not shard).",
            ]
        else:
            said = [
                f"# Fused: {self.q} + {self.k} + {self.v} -> {s.merged}. Each rank holds its own heads",
                "# of q, k and v; with fewer kv heads than ranks, k and v are replicated.",
            ]
            if self.disable_tp:
                said.append("# Whole on every rank where `disable_tp` holds.")
        lines = [
            *said,
            f"self.{s.merged} = QKVParallelLinear({code(s.hidden_size)}, {hd}, {code(s.num_heads)}, "
            f"{code(s.num_kv_heads)}, bias={code(s.bias)}, {disable_tp}quant_config=quant_config, "
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
