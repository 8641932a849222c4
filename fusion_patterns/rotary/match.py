"""What the rope pattern looks for in a copied attention's forward: one parameter
unpacked into two tables (`cos, sin = position_embeddings`), and module functions that
take a query, a key and those tables and bind two names (`q, k = f(q, k, cos, sin)`).
vLLM's rope rotates in place, so the tensors handed in must not be read again after."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from ..base import PatternRefused, code

NAME = "rope"
WHAT = "rotary embedding"


@dataclass
class RopeSpec:
    """One copied attention's proven rope: the functions replaced, and the
    `get_rope` the generated `__init__` builds."""

    functions: dict[str, int]  # function name -> the token axis of its q and k
    tables: tuple[str, str]  # the names the layer's tables are unpacked to
    param: str  # the forward parameter holding the tables
    head: str
    rope: str
    rope_dim: str | None
    neox: bool
    attr: str
    unrun: list[str] = field(default_factory=list)
    # the forward no longer reads the tables: callers stop handing them
    drop: bool = False


def find_calls(forward: cst.FunctionDef) -> tuple[str, tuple[str, str], list[cst.Call]]:
    """(param, (cos, sin), the calls `f(q, k, cos, sin, ...)` bound to two names) in a
    forward that unpacks one of its parameters into two tables."""
    params = {p.name.value for p in forward.params.params} | {
        p.name.value for p in forward.params.kwonly_params
    }
    unpacks = [
        a
        for a in m.findall(
            forward.body,
            m.Assign(
                targets=[
                    m.AssignTarget(m.Tuple([m.Element(m.Name()), m.Element(m.Name())]))
                ],
                value=m.Name(),
            ),
        )
        if a.value.value in params
    ]
    for unpack in unpacks:
        cos, sin = (e.value.value for e in unpack.targets[0].target.elements)
        calls = [
            a.value
            for a in m.findall(
                forward.body,
                m.Assign(
                    targets=[
                        m.AssignTarget(
                            m.Tuple([m.Element(m.Name()), m.Element(m.Name())])
                        )
                    ],
                    value=m.Call(
                        func=m.Name(),
                        args=[
                            m.Arg(keyword=None),
                            m.Arg(keyword=None),
                            m.Arg(m.Name(cos), keyword=None),
                            m.Arg(m.Name(sin), keyword=None),
                            m.ZeroOrMore(),
                        ],
                    ),
                ),
            )
        ]
        if calls:
            return unpack.value.value, (cos, sin), calls
    return "", ("", ""), []


def condition(forward: cst.FunctionDef) -> str | None:
    """The test of the tables an `if` unpacks them under (`if position_embeddings is
    not None:`: a NoPE layer or config hands none), or None.
    vLLM's rope built in `__init__` would rotate where the source does not."""
    param, _, calls = find_calls(forward)
    if not calls:
        return None
    for node in m.findall(forward.body, m.If()):
        # a test of the tables themselves: the caller decides (a layer's own flag,
        # `if self.use_rope:`, is the layer's, and stays around vLLM's rope)
        if m.findall(node.body, m.Assign(value=m.Name(param))) and m.findall(
            node.test, m.Name(param)
        ):
            return code(node.test)
    return None


def require_unread_after(forward: cst.FunctionDef, call: cst.Call) -> None:
    """vLLM's rope rotates q and k in place: the source must not read the tensors it
    handed its function after the call, except as the names the call rebinds."""
    import re

    text = code(forward)
    stmt = code(call)
    after = text[text.index(stmt) + len(stmt) :]
    for arg in call.args[:2]:
        name = code(arg.value)
        if not re.fullmatch(r"\w+", name):
            base = re.match(r"\w+", name)
            name = base.group(0) if base else name
        # the statement rebinds it, or nothing reads it again
        if re.search(rf"\b{re.escape(name)}\b", after) and not _rebinds(
            forward, call, name
        ):
            raise PatternRefused(f"`{name}` is read after the rotary call")


def _rebinds(forward: cst.FunctionDef, call: cst.Call, name: str) -> bool:
    for assign in m.findall(forward.body, m.Assign(value=m.Call())):
        if assign.value.deep_equals(call):
            return name in {code(e.value) for e in assign.targets[0].target.elements}
    return False
