"""The rope pattern's rewrite of the copied attention: `get_rope` at the end of
`__init__`, each proven call -> `self._vllm_rope(positions, q, k)` (a method that hands
vLLM's rope the source's tensors in its layout), the tables' unpacking dropped where
nothing reads them any more."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ..base import code, with_positions_param
from ..emitting import DefaultNone
from .match import RopeSpec

MAX_POSITION = "config.max_position_embeddings"


METHOD = """
    def _vllm_rope(self, positions, query, key):
        # vLLM's rope takes [tokens, heads * head size]; the source holds
        # {layout}
        tokens = positions.shape[-1]
        q, k = (t{to_tokens}.reshape(tokens, -1) for t in (query, key))
        q, k = self.{attr}(positions, q, k)
        return tuple(
            r.view(t{shape}){from_tokens} for r, t in ((q, query), (k, key))
        )
"""


LAYOUTS = {  # the source's token axis -> (layout, to tokens first, shape, back)
    1: ("[1, tokens, heads, head size]", "", ".shape", ""),
    2: (
        "[1, heads, tokens, head size]",
        ".transpose(1, 2)",
        ".transpose(1, 2).shape",
        ".transpose(1, 2)",
    ),
}


def construction(spec: RopeSpec) -> str:
    rope = spec.rope
    if spec.rope_dim is not None:
        rope = f'{{**{rope}, "rope_dim": {spec.rope_dim}}}'
    return (
        f"self.{spec.attr} = get_rope({spec.head}, max_position={MAX_POSITION}, "
        f"is_neox_style={spec.neox}, rope_parameters={rope})"
    )


def dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text).strip("\n") + "\n"


class Replace(cst.CSTTransformer):
    def __init__(self, spec: RopeSpec):
        self.spec = spec

    def leave_Assign(self, original, updated: cst.Assign):
        value = updated.value
        if not (
            isinstance(value, cst.Call)
            and m.matches(value.func, m.Name())
            and value.func.value in self.spec.functions
        ):
            return updated
        q, k = (code(a.value) for a in value.args[:2])
        return updated.with_changes(
            value=cst.parse_expression(f"self._vllm_rope(positions, {q}, {k})")
        )


class DropUnpack(cst.CSTTransformer):
    def __init__(self, spec: RopeSpec):
        self.spec = spec

    def leave_SimpleStatementLine(self, original, updated):
        if len(updated.body) == 1 and m.matches(
            updated.body[0],
            m.Assign(
                targets=[
                    m.AssignTarget(
                        m.Tuple(
                            [
                                m.Element(m.Name(self.spec.tables[0])),
                                m.Element(m.Name(self.spec.tables[1])),
                            ]
                        )
                    )
                ],
                value=m.Name(self.spec.param),
            ),
        ):
            return cst.RemoveFromParent()
        return updated


def rewrite_forward(forward: cst.FunctionDef, spec: RopeSpec) -> cst.FunctionDef:
    forward = forward.visit(Replace(spec))
    if spec.drop:
        forward = forward.visit(DropUnpack(spec)).visit(DefaultNone({spec.param}))
    return with_positions_param(forward)


def tables_unread(forward: cst.FunctionDef, spec: RopeSpec) -> bool:
    """Once the calls are replaced and the unpacking dropped, nothing reads the tables
    (the parameter's own name is its one remaining occurrence)."""
    if spec.unrun:
        return False
    replaced = forward.visit(Replace(spec))
    if any(len(m.findall(replaced, m.Name(t))) != 1 for t in spec.tables):
        return False
    dropped = replaced.visit(DropUnpack(spec))
    return len(m.findall(dropped, m.Name(spec.param))) == 1
