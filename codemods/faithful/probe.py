"""Run the source's own tiny model once and record what the faithful emitter needs to
know about it: the modules each class is instantiated as, and, for every attention
layer, what it hands its attention interface (query/key/value, the mask, the keyword
arguments) and what that interface returns.

The attention interface is reached through the source's eager function (the default
of `ALL_ATTENTION_FUNCTIONS.get_interface(...)`); the probe wraps that function in the
module's namespace for one forward, so every layer is seen in one pass.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, code

PROBE_TOKENS = 16  # longer than the tiny sliding window, so windows show in the masks


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


@dataclass
class Probe:
    model: object
    config: object
    # class name -> [(module path in the causal LM, instance)]
    instances: dict[str, list[tuple[str, object]]] = field(default_factory=dict)
    calls: list[AttentionCall] = field(default_factory=list)

    def first(self, cls: str):
        found = self.instances.get(cls)
        return found[0][1] if found else None

    def calls_of(self, cls: str) -> list[AttentionCall]:
        return [c for c in self.calls if type(c.module).__name__ == cls]


def interface_name(forward: cst.FunctionDef) -> str | None:
    """The local name an attention interface is called through: `X(self, q, k, v, ...)`
    where X is assigned from an `ALL_ATTENTION_FUNCTIONS` lookup or an eager function."""
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


def run(
    pymodule: types.ModuleType,
    model,
    config,
    attention_classes: dict[str, ClassInfo],
    vocab: int,
) -> Probe:
    """One forward of `model` with every attention class's eager function wrapped."""
    import torch

    probe = Probe(model=model, config=config)
    for path, module in model.named_modules():
        probe.instances.setdefault(type(module).__name__, []).append((path, module))
    paths = {id(mod): path for path, mod in model.named_modules()}

    functions = {
        name
        for name, value in vars(pymodule).items()
        if isinstance(value, types.FunctionType)
    }
    wrapped: dict[str, object] = {}
    for info in attention_classes.values():
        if info.forward is None:
            continue
        for name in eager_functions(info.forward, functions):
            wrapped[name] = getattr(pymodule, name)

    seen: set[int] = set()

    def wrap(original):
        signature = inspect.signature(original)

        def recording(module, query, key, value, attention_mask, *args, **kwargs):
            out = original(module, query, key, value, attention_mask, *args, **kwargs)
            if id(module) not in seen:
                # positional extras (a scaling passed by position) by their names
                bound = signature.bind_partial(
                    module, query, key, value, attention_mask, *args, **kwargs
                ).arguments
                named = dict(list(bound.items())[5:])
                named.update(named.pop("kwargs", {}) or {})
                seen.add(id(module))
                probe.calls.append(
                    AttentionCall(
                        module=module,
                        path=paths.get(id(module), ""),
                        query=query.detach().clone(),
                        key=key.detach().clone(),
                        value=value.detach().clone(),
                        mask=None
                        if attention_mask is None
                        else attention_mask.detach().clone(),
                        kwargs={k: _detach(v) for k, v in named.items()},
                        output=(out[0] if isinstance(out, tuple) else out)
                        .detach()
                        .clone(),
                    )
                )
            return out

        return recording

    for name, original in wrapped.items():
        setattr(pymodule, name, wrap(original))
    try:
        with torch.no_grad():
            ids = torch.randint(
                0, vocab, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(3)
            )
            model(input_ids=ids, use_cache=False)
    finally:
        for name, original in wrapped.items():
            setattr(pymodule, name, original)
    return probe


def _detach(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def source_text(node: cst.CSTNode) -> str:
    return code(node)
