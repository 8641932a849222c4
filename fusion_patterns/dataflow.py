"""Small helpers over torch.fx graphs and numbers, shared by the patterns' proofs.

The graphs come from vLLM's own Transformers-backend tracer (every submodule a leaf,
the attention interface one opaque call), so what is proven here is the same dataflow
the backend would fuse at load time."""

from __future__ import annotations

import torch
from torch import fx, nn

from .base import PatternRefused

REL_TOL = 1e-5


def trace(module: nn.Module, concrete: dict | None = None) -> fx.Graph:
    """vLLM's trace of `module.forward` (its `past_key_values` None); `concrete`: more
    parameters at the values the generated file always has (a cross-attention's
    `key_value_states` None), so the trace takes the path the file runs."""
    from vllm.model_executor.models.transformers.fx_utils import trace as vllm_trace

    graph = vllm_trace(module) if not concrete else _trace_with(module, concrete)
    if graph is None:
        raise PatternRefused(f"{type(module).__name__}.forward could not be traced")
    return graph


def _trace_with(module: nn.Module, concrete: dict) -> fx.Graph | None:
    """vLLM's `fx_utils.trace`, with `concrete` among its concrete arguments."""
    import inspect

    from vllm.model_executor.models.transformers import fx_utils

    parameters = fx_utils.forward_parameters(type(module))
    concrete_args = {k: v for k, v in concrete.items() if k in parameters}
    if "past_key_values" in parameters:
        concrete_args["past_key_values"] = None
    tracer = fx_utils._AllLeafTracer()
    tracer.varkw = next(
        (
            p.name
            for p in parameters.values()
            if p.kind is inspect.Parameter.VAR_KEYWORD
        ),
        None,
    )
    try:
        with fx_utils._leaf_attention_interfaces():
            return tracer.trace(module, concrete_args=concrete_args)
    except Exception:  # noqa: BLE001 - the partial graph, as vLLM's trace returns it
        return getattr(tracer, "graph", None)


def module_calls(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    out: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_module":
            out.setdefault(str(node.target), []).append(node)
    return out


def single_call(graph: fx.Graph, name: str) -> fx.Node:
    calls = module_calls(graph).get(name, [])
    if len(calls) != 1:
        raise PatternRefused(
            f"self.{name} is called {len(calls)} times in the traced forward"
        )
    return calls[0]


def inputs_of(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


# reads of a tensor's metadata, which carry none of its values (Cohere's rope casts the
# key back with `.to(dtype=q.dtype)`: no value of the query reaches the key)
METADATA_ATTRS = {"dtype", "device", "shape", "ndim", "is_cuda"}
METADATA_METHODS = {"size", "dim"}


def _metadata_read(node: fx.Node) -> bool:
    import operator

    if node.op == "call_function" and node.target in (getattr, operator.attrgetter):
        return len(node.args) > 1 and node.args[1] in METADATA_ATTRS
    return node.op == "call_method" and node.target in METADATA_METHODS


def upstream_linears(node: fx.Node, root: nn.Module) -> set[str]:
    """Names of the nn.Linear submodules whose outputs flow into `node` (values, not
    metadata: a dtype or a size read from a tensor is no dataflow from it)."""
    seen, found, stack = set(), set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current is not node and _metadata_read(current):
            continue
        if current.op == "call_module" and isinstance(
            root.get_submodule(str(current.target)), nn.Linear
        ):
            found.add(str(current.target))
            continue
        stack.extend(inputs_of(current))
    return found


def mutated_in_place(node: fx.Node) -> list[str]:
    """In-place tensor methods (`x.add_(...)`) applied to `node`."""
    return [
        str(user.target)
        for user in node.users
        if user.op == "call_method"
        and str(user.target).endswith("_")
        and not str(user.target).startswith("__")
    ]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(
        (got.float() - want.float()).abs().max()
        / want.float().abs().max().clamp_min(1e-12)
    )


def require_close(
    got: torch.Tensor, want: torch.Tensor, what: str, tol: float = REL_TOL
) -> None:
    if got.shape != want.shape:
        raise PatternRefused(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = rel_err(got, want)
    if not err <= tol:
        raise PatternRefused(
            f"{what}: the fused form differs (max rel err {err:.1e} > {tol:.0e})"
        )


def round_weights(module: nn.Module, dtype: torch.dtype) -> None:
    """Every parameter of `module` made a value of `dtype`, kept in its own dtype: an
    engine loading it in `dtype` holds the very weights `module` computes with."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(dtype).to(p.dtype))
