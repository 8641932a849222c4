"""What an attention call looks like: in the source (the local name a class calls its
attention interface through, and that call) and at run time (what one layer handed
it and what it returned). Read by the probe, the roles and the copied attention."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m


@dataclass
class AttentionCall:
    module: object
    path: str
    query: object
    key: object
    value: object
    mask: object
    kwargs: dict
    output: object


@functools.lru_cache(maxsize=256)  # nodes hash by identity; asked often per forward
def interface_name(forward: cst.FunctionDef) -> str | None:
    """The local name an attention interface is called through: `X(self, q, k, v, ...)`
    where X is assigned from an `ALL_ATTENTION_FUNCTIONS` lookup or an eager function.
    """
    assigned = {}
    for node in m.findall(forward, m.Assign() | m.AnnAssign()):
        targets = (
            [t.target for t in node.targets]
            if isinstance(node, cst.Assign)
            else [node.target]
        )
        for t in targets:
            if isinstance(t, cst.Name) and node.value is not None:
                assigned.setdefault(t.value, []).append(node.value)
    for call in m.findall(
        forward, m.Call(func=m.Name(), args=[m.Arg(m.Name("self")), m.ZeroOrMore()])
    ):
        name = call.func.value
        values = assigned.get(name, [])
        if any(m.findall(v, m.Name("ALL_ATTENTION_FUNCTIONS")) for v in values):
            return name
    return None


def eager_functions(forward: cst.FunctionDef, module_functions: set[str]) -> set[str]:
    """Module-level functions the interface name may be bound to (the eager default)."""
    name = interface_name(forward)
    if name is None:
        return set()
    out = set()
    for node in m.findall(forward, m.Assign() | m.AnnAssign()):
        targets = (
            [t.target for t in node.targets]
            if isinstance(node, cst.Assign)
            else [node.target]
        )
        if any(isinstance(t, cst.Name) and t.value == name for t in targets):
            out |= {
                n.value
                for n in m.findall(node.value, m.Name())
                if n.value in module_functions
            }
    return out


def interface_call(forward: cst.FunctionDef) -> cst.Call | None:
    name = interface_name(forward)
    if name is None:
        return None
    calls = m.findall(forward, m.Call(func=m.Name(name)))
    return calls[0] if len(calls) == 1 else None
