"""The MoE block's proof: its output against vLLM's fused-MoE computation on the
module's own weights: softmax(x W_r^T) -> top-k -> (renormalise) -> sum_k w_k
down_e(act(gate_e x) * up_e x). A renormalisation flag is proven both ways (the module
is run with it flipped)."""

from __future__ import annotations

import libcst as cst

from ..base import PatternRefused, code
from .match import MoESpec


def evaluate(expr: cst.BaseExpression, config, what: str):
    try:
        return eval(
            code(expr), {"config": config, "True": True, "False": False}
        )  # noqa: S307
    except Exception as exc:
        raise PatternRefused(
            f"{what} `{code(expr)}` cannot be evaluated: {exc}"
        ) from None


def fused_reference(x, logits, gate_up, down, act_and_mul, routing: dict):
    """vLLM's FusedMoE, written out: its own routing function (`grouped_topk`, which
    covers plain top-k as one group), then one token and one chosen expert at a time."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import (
        grouped_topk,
    )

    import torch

    # eagerly: vLLM compiles this function, and compiling it (once per routing flag
    # set, up to dynamo's recompile limit) costs a proof seconds for the same numbers
    with torch.compiler.set_stance("force_eager"):
        weights, chosen = grouped_topk(x, logits.float(), **routing)
    return experts_reference(x, chosen, weights, gate_up, down, act_and_mul)


def experts_reference(
    x, chosen, weights, gate_up, down, act_and_mul, gate_up_bias=None, down_bias=None
):
    """What vLLM's fused experts compute once routed, one token and one chosen expert
    at a time: sum_k w_k down_e(act_and_mul(gate_up_e x + b13_e)) + b2_e (gate_up
    [E, 2I, H], down [E, H, I], as vLLM's w13 and w2 hold them)."""
    import torch

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], chosen[t]):
            h = x[t : t + 1] @ gate_up[e].T
            if gate_up_bias is not None:
                h = h + gate_up_bias[e]
            o = act_and_mul(h) @ down[e].T
            if down_bias is not None:
                o = o + down_bias[e]
            out[t] += w.to(x.dtype) * o[0]
    return out


def prove(spec: MoESpec, module, config) -> None:
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.activation import get_act_and_mul_fn
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from ..dataflow import require_close

    act = str(evaluate(spec.activation, config, "the activation key"))
    try:
        MoEActivation.from_str(act)
        act_and_mul = get_act_and_mul_fn(act).forward_native
    except ValueError:
        raise PatternRefused(f"vLLM's fused MoE has no activation {act!r}") from None
    import copy

    module = copy.deepcopy(module)
    router = getattr(module, spec.router_attr)
    experts = getattr(module, spec.experts_attr)
    r = spec.router
    # any other state of the block that could move the routing (a correction bias held
    # by the block and handed to the router) gets values that bite: unread by the
    # fused form, it makes the outputs differ
    known = {
        id(getattr(router, r.weight)),
        id(getattr(experts, spec.experts.gate_up)),
        id(getattr(experts, spec.experts.down)),
    }
    shared = getattr(module, spec.shared_attr) if spec.shared_attr else None
    skip = {id(t) for t in (shared.parameters() if shared is not None else [])}
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) not in known and id(t) not in skip and t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=gen))
    routing = {
        "topk": int(evaluate(spec.top_k, config, "top-k")),
        "renormalize": bool(evaluate(spec.renormalize, config, "the renormalisation")),
        "scoring_func": r.scoring,
        "num_expert_group": 1,
        "topk_group": 1,
    }
    if r.groups is not None:
        routing["num_expert_group"] = int(
            evaluate(spec.resolved("num_expert_group"), config, "groups")
        )
        routing["topk_group"] = int(
            evaluate(spec.resolved("topk_group"), config, "top-k groups")
        )
    if r.scale is not None:
        routing["routed_scaling_factor"] = float(
            evaluate(
                spec.resolved("routed_scaling_factor"),
                config,
                "the routed scaling factor",
            )
        )
    weight = getattr(router, r.weight)
    hidden = weight.shape[1]
    x = torch.randn(2, 32, hidden, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if r.bias is not None:
            # a bias that moves the choice: random, so a dropped bias shows
            bias = getattr(router, r.bias)
            bias.copy_(
                torch.randn(bias.shape, generator=torch.Generator().manual_seed(1))
            )
            routing["e_score_correction_bias"] = bias
        cases = [routing["renormalize"]]
        if r.flag is not None:
            cases.append(not routing["renormalize"])
        for renorm in cases:
            if r.flag is not None:
                setattr(router, r.flag, renorm)
            try:
                got = module(x)
            finally:
                if r.flag is not None:
                    setattr(router, r.flag, routing["renormalize"])
            flat = x.reshape(-1, hidden)
            want = fused_reference(
                flat,
                F.linear(flat.float(), weight.float()),
                getattr(experts, spec.experts.gate_up),
                getattr(experts, spec.experts.down),
                act_and_mul,
                {**routing, "renormalize": renorm},
            )
            if spec.shared_attr:
                want = want + getattr(module, spec.shared_attr)(flat)
            require_close(
                want,
                got.reshape(-1, hidden),
                f"{spec.class_name} as FusedMoE (renormalize={renorm})",
            )
