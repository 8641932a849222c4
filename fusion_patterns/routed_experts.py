"""Experts routed by the source's own router -> vLLM's fused MoE layer (external routing).

Where the MoE block pattern cannot prove a router (a router vLLM's routing would compute
differently: jitter, a sparse mixer, a softmax after the top-k, ...), the block is copied,
and with it transformers' loop over the experts a batch hits (`.nonzero()`, a host sync
per pass, torch.compile off, every expert whole on every TP rank). This pattern takes the
experts alone, as vLLM's Transformers backend does: the block keeps its router as the
source computes it, and its top-k weights and ids are handed to `FusedMoEFactory`
through a custom routing function (vLLM's `TransformersMoERunner`, whose forward takes
transformers' `experts(hidden_states, top_k_index, top_k_weights)`).

Matched as the MoE block's experts are (`moe.match.match_experts`: stacked 3-D
`gate_up` [E, 2I, H] and `down` [E, H, I], `act(gate) * up`); proven on the module the
tiny model built, called as its block calls it, against the fused computation written
out: sum over the chosen experts of weight * down_e(act(gate_e x) * up_e x).
"""

from __future__ import annotations

import libcst.matchers as m

from .base import (
    CLASS,
    Claim,
    ClassInfo,
    FusionRecord,
    Pattern,
    PatternRefused,
    code,
    refused_by,
)
from .emitting import EXTRA_PARAMS, EXTRAS, source_params
from .moe.match import match_experts, resolve
from .moe.proof import evaluate, experts_reference

NAME = "routed_experts"
WHAT = "experts (the source's router)"
VLLM_CLASS = "FusedMoE"
ROUTING = "external routing: the block's own router picks the experts"


class RoutedExperts(Pattern):
    name = NAME

    def claim(self, model):
        for n in model.sublayer_candidates():
            info = model.classes[n]
            inst = model.first(n)
            seen = model.call(inst) if inst is not None else None
            if not _called_as_experts(seen) or _taken_with_its_block(model, n):
                continue
            try:
                spec = match_experts(info)
                if spec is None:
                    raise PatternRefused(
                        "their forward is not `act(gate) * up` on a stacked [gate; up] "
                        "parameter, then one down projection, per expert"
                    )
                top_k = _prove(model, info, spec, inst, seen)
            except Exception as exc:
                yield refused_by(exc, NAME, n, WHAT)
                continue
            yield Claim(
                self,
                n,
                (spec, top_k),
                CLASS,
                records=[
                    FusionRecord(
                        NAME,
                        n,
                        (spec.gate_up, spec.down),
                        "experts",
                        VLLM_CLASS,
                        scope=scope,
                        detail=ROUTING,
                    )
                    for scope in model.roles.scopes.get(n, [""])
                ],
                experts=(spec.gate_up, spec.down),
            )

    def emit_class(self, claim: Claim, info: ClassInfo) -> str:
        spec, top_k = claim.spec
        sizes = {
            "num_experts": spec.num_experts,
            "hidden_size": spec.hidden,
            "intermediate_size": spec.intermediate,
            "activation": spec.act_name,
        }
        args = "".join(
            f"        {k}={code(resolve(v, info, {}))},\n" for k, v in sizes.items()
        )
        params = ", ".join([*source_params(info), *(EXTRA_PARAMS[e] for e in EXTRAS)])
        return f'''
def {info.name}({params}):
    """{info.name} as vLLM's fused MoE layer, routed externally: the block's own
    router (the source's) picks the experts and hands over their ids and weights."""
    state = TransformersMoEState()

    def chosen_by_the_source(hidden_states, gating_output, topk, renormalize, moe_state):
        # `gating_output` is the source router's top-k weights; the ids were stored
        # by the runner's forward
        return gating_output, moe_state.topk_ids

    return FusedMoEFactory(
{args}        top_k={top_k},
        renormalize=False,
        custom_routing_function=partial(chosen_by_the_source, moe_state=state),
        runner_cls=TransformersMoERunner,
        runner_args={{"moe_state": state}},
        quant_config=quant_config,
        prefix=prefix,
    )
'''


def _owners(model, cls: str) -> list[tuple[ClassInfo, str]]:
    """(class, attribute) of every `self.<attr> = <cls>(...)` among the source classes."""
    return [
        (info, attr)
        for info in model.classes.values()
        for attr in info.attrs
        if info.constructed_class(attr) == cls
    ]


def _taken_with_its_block(model, cls: str) -> bool:
    owners = _owners(model, cls)
    return bool(owners) and all(model.claimed_whole(o.name) for o, _ in owners)


def _handed(seen) -> list:
    """What the probe saw the module called with, positional then keyword, in order."""
    return [*seen[0], *seen[1].values()] if seen is not None else []


def _called_as_experts(seen) -> bool:
    """Called (hidden, top-k ids, top-k weights), as transformers' experts are."""
    handed = _handed(seen)
    if len(handed) != 3:
        return False
    x, ids, weights = handed
    return (
        all(hasattr(t, "is_floating_point") for t in (x, ids, weights))
        and not ids.is_floating_point()
        and weights.is_floating_point()
        and ids.shape == weights.shape
    )


def _prove(model, info: ClassInfo, spec, inst, seen) -> str:
    """The top-k expression (over the experts' own constructor parameters), once the
    experts are proven to compute the fused form as their block calls them."""
    import copy

    import torch

    from vllm.model_executor.layers.activation import get_act_and_mul_fn
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    from .dataflow import require_close

    for owner, attr in _owners(model, info.name):
        if attr != "experts":
            # vLLM's fused MoE loader finds expert tensors under `experts.`
            raise PatternRefused(
                f"{owner.name} holds them as self.{attr}, not self.experts"
            )
        calls = m.findall(
            owner.forward,
            m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(attr))),
        )
        if (
            len(calls) != 1
            or len(calls[0].args) != 3
            or any(a.keyword is not None or a.star for a in calls[0].args)
        ):
            raise PatternRefused(
                f"{owner.name} does not call self.{attr}(hidden, top-k ids, top-k weights) "
                "once, positionally"
            )
    ids = _handed(seen)[1]
    k = ids.shape[-1]
    top_k = _top_k(model, info, k)
    act = str(
        evaluate(resolve(spec.act_name, info, {}), model.config, "the activation key")
    )
    try:
        MoEActivation.from_str(act)
        act_and_mul = get_act_and_mul_fn(act).forward_native
    except ValueError:
        raise PatternRefused(f"vLLM's fused MoE has no activation {act!r}") from None
    module = copy.deepcopy(inst)
    gate_up, down = getattr(module, spec.gate_up), getattr(module, spec.down)
    extra = [
        n for n, _ in module.named_parameters() if n not in (spec.gate_up, spec.down)
    ]
    if extra:
        raise PatternRefused(
            f"they also hold {', '.join(extra)} (biases are not emitted yet)"
        )
    experts = gate_up.shape[0]
    sizes = (spec.num_experts, spec.intermediate, spec.hidden)
    built = tuple(
        evaluate(resolve(e, info, {}), model.config, "an experts size") for e in sizes
    )
    if built != (experts, down.shape[-1], gate_up.shape[-1]):
        raise PatternRefused(
            f"their sizes read from the config {built} are not the ones built "
            f"{(experts, down.shape[-1], gate_up.shape[-1])}"
        )
    gen = torch.Generator().manual_seed(7)
    tokens = 24
    with torch.no_grad():
        gate_up.copy_(
            torch.randn(gate_up.shape, generator=gen) / gate_up.shape[-1] ** 0.5
        )
        down.copy_(torch.randn(down.shape, generator=gen) / down.shape[-1] ** 0.5)
        x = torch.randn(tokens, gate_up.shape[-1], generator=gen)
        chosen = torch.stack(
            [torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)]
        ).to(ids.dtype)
        w = torch.rand(tokens, k, generator=gen)
        got = module(x, chosen, w)
        want = experts_reference(x, chosen, w, gate_up, down, act_and_mul)
    require_close(got, want, f"{info.name} as FusedMoE with the source's routing")
    return top_k


def _top_k(model, info: ClassInfo, k: int) -> str:
    """`config.<name>`: the config field the experts' block reads whose value is the
    top-k the tiny model ran (the experts themselves never see it); where tiny values
    coincide, the one a `topk(..., k)` in the block or its router takes."""
    if info.init is None or "config" not in {
        p.name.value for p in info.init.params.params
    }:
        raise PatternRefused(
            f"{info.name} is not built from the config (its top-k is unknown)"
        )
    read: set[str] = set()
    as_k: set[str] = set()
    for owner, _ in _owners(model, info.name):
        built = (
            model.classes.get(owner.constructed_class(a) or "") for a in owner.attrs
        )
        for cls in (owner, *built):
            if cls is None:
                continue
            read |= {n.attr.value for n in m.findall(cls.node, _CONFIG_FIELD)}
            as_k |= set(_topk_fields(cls))
    fields = {
        name
        for name in read
        if type(getattr(model.config, name, None)) is int
        and getattr(model.config, name) == k
    }
    if len(fields & as_k) == 1:
        fields &= as_k
    if len(fields) != 1:
        found = ", ".join(sorted(fields)) or "none"
        raise PatternRefused(
            f"the top-k ({k} in the tiny model) is not one config field its block reads "
            f"(candidates: {found})"
        )
    return f"config.{fields.pop()}"


_CONFIG_FIELD = m.Attribute(value=m.Name("config"))
_TOPK = m.Call(func=m.Attribute(attr=m.Name("topk")) | m.Name("topk"))


def _topk_fields(info: ClassInfo):
    """The config fields a `topk` call of `info` takes as its k, through `self.<attr>`."""
    for call in m.findall(info.node, _TOPK):
        keyword = [a.value for a in call.args if a.keyword and a.keyword.value == "k"]
        positional = [a.value for a in call.args if a.keyword is None]
        for value in keyword or positional[1:2]:
            if m.matches(value, m.Attribute(value=m.Name("self"))):
                value = info.attrs.get(value.attr.value)
            if m.matches(value, _CONFIG_FIELD):
                yield value.attr.value
