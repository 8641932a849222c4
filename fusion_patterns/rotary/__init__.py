"""The source's rotary code in a copied attention -> vLLM's rope (`get_rope`).

Where the attention is copied (no pattern claimed it whole), the statement
`q, k = apply_rotary_pos_emb(q, k, cos, sin)` that reads the tables the layer was handed
(`cos, sin = position_embeddings`) becomes vLLM's rope on vLLM's positions:
`self.rotary_emb = get_rope(...)` at the end of `__init__`, the statement
`q, k = self._vllm_rope(positions, q, k)`. Proven on every layer of the tiny model that
runs it, against what the source's function returns there: the `get_rope` the file
builds (head size, rotated dims, NeoX halves or GPT-J pairs, the config's rope
parameters, per layer type where the source keeps one rope each), read from the same
expressions the generated `__init__` evaluates; and once more with every rope theta of
the config changed, the source's rotary module rebuilt from it, so a source that does
not read its rope from `config.rope_parameters` is never taken for one that does. A
function that never ran in the tiny model stays as the source has it.
"""

from __future__ import annotations

import libcst as cst

from ..base import (
    REWRITE,
    Claim,
    FusionRecord,
    Pattern,
    Refusal,
    refused_by,
)
from ..emitting import with_keyword
from .emit import LAYOUTS, METHOD, construction, dedent, rewrite_forward
from .match import NAME, WHAT, RopeSpec, condition, find_calls
from .proof import prove


class Rope(Pattern):
    name = NAME
    rewrites_calls = True

    def claim(self, model):
        for n, attention in model.roles.attention.items():
            info = model.classes[n]
            if model.claimed_whole(n) or info.forward is None:
                continue
            param, tables, calls = find_calls(info.forward)
            if not calls:
                continue
            if (test := condition(info.forward)) is not None:
                yield Refusal(NAME, n, WHAT, _conditional(test))
                continue
            if attention.eager is not None:
                # the copy rewrites such a class's attention core by finding its
                # statements as they are; a rewrite before it would hide them
                yield Refusal(
                    NAME,
                    n,
                    WHAT,
                    "the class computes attention itself (its core becomes vLLM's "
                    "attention); vLLM's rope is not applied inside such a class",
                )
                continue
            try:
                spec = prove(model, n, param, tables, calls)
            except Exception as exc:  # a proof that fails or cannot run is a refusal
                yield refused_by(exc, NAME, n, WHAT)
                continue
            style = "NeoX halves" if spec.neox else "GPT-J pairs"
            yield Claim(
                self,
                n,
                spec,
                REWRITE,
                records=[
                    FusionRecord(
                        NAME,
                        n,
                        tuple(spec.functions),
                        spec.attr,
                        "get_rope",
                        detail=style,
                    )
                ],
                needs_positions=True,
            )
            for f in spec.unrun:
                yield Refusal(
                    NAME,
                    n,
                    f"{WHAT} {f}",
                    "never runs in the tiny model: kept as the source",
                )

    def rewrite_class(self, claim: Claim, node: cst.ClassDef) -> cst.ClassDef:
        spec: RopeSpec = claim.spec
        body = []
        for stmt in node.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                stmt = stmt.with_changes(
                    body=stmt.body.with_changes(
                        body=[*stmt.body.body, cst.parse_statement(construction(spec))]
                    )
                )
            elif isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                stmt = rewrite_forward(stmt, spec)
            body.append(stmt)
        axis = next(iter(spec.functions.values()))
        layout, to_tokens, shape, back = LAYOUTS[axis]
        method = METHOD.format(
            layout=layout,
            to_tokens=to_tokens,
            shape=shape,
            from_tokens=back,
            attr=spec.attr,
        )
        body.append(cst.parse_module(dedent(method)).body[0])
        return node.with_changes(body=node.body.with_changes(body=body))

    def call_site(self, claim: Claim, call: cst.Call) -> cst.BaseExpression | None:
        spec: RopeSpec = claim.spec
        args = [
            a
            for a in call.args
            if a.keyword is None or a.keyword.value != spec.param or not spec.drop
        ]
        if len(args) != len(call.args):  # the commas of the rest, black re-lays them
            args = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in args]
        return with_keyword(call.with_changes(args=args), "positions", "positions")


def _conditional(test: str) -> str:
    return (
        f"the rope is applied only `if {test}` (a layer or config without rope hands "
        "no tables), which vLLM's rope built in `__init__` would not follow"
    )
