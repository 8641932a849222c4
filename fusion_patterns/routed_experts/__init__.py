"""Experts routed by the source's own router -> vLLM's fused MoE layer (external routing).

Where the MoE block pattern cannot prove a router (a router vLLM's routing would compute
differently: jitter, a sparse mixer, a softmax after the top-k, ...), the block is copied,
and with it transformers' loop over the experts a batch hits (`.nonzero()`, a host sync
per pass, torch.compile off, every expert whole on every TP rank). This pattern takes the
experts alone, as vLLM's Transformers backend does: the block keeps its router as the
source computes it, and its top-k weights and ids are handed to `FusedMoEFactory`
through a custom routing function (vLLM's `TransformersMoERunner`, whose forward takes
transformers' `experts(hidden_states, top_k_index, top_k_weights)`).

The experts come in forms, one module each (`glu.py`: transformers' stacked [E, 2I, H]
`act(gate) * up`; `transposed.py`: [E, H, 2I] applied as `x @ W`, in halves (Aria) or
GPT-OSS's interleaved, clamped, biased gate): each
matched on the class, proven on the module the tiny model built, called as its block
calls it, against vLLM's fused computation written out: sum over the chosen experts of
weight * down_e(act(gate_up_e x)).
"""

from __future__ import annotations

import libcst.matchers as m

from ..base import (
    CLASS,
    Claim,
    ClassInfo,
    FusionRecord,
    Pattern,
    PatternRefused,
    code,
    refused_by,
)
from ..emitting import EXTRA_PARAMS, EXTRAS, source_params
from . import glu, transposed

# the experts forms, in the order they are tried
FORMS = (glu, transposed)

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
                form = _form(info)
                form, top_k = _prove(model, info, form, inst, seen)
            except Exception as exc:
                yield refused_by(exc, NAME, n, WHAT)
                continue
            yield Claim(
                self,
                n,
                (form, top_k),
                CLASS,
                records=[
                    FusionRecord(
                        NAME,
                        n,
                        form.sources,
                        "experts",
                        VLLM_CLASS,
                        scope=scope,
                        detail=ROUTING,
                    )
                    for scope in model.roles.scopes.get(n, [""])
                ],
                experts=form.stacked,
            )

    def emit_class(self, claim: Claim, info: ClassInfo) -> str:
        form, top_k = claim.spec
        args = "".join(
            f"        {k}={code(v)},\n" for k, v in form.factory_args(info).items()
        )
        guards = "".join(f"    {line}\n" for line in form.guards())
        params = ", ".join([*source_params(info), *(EXTRA_PARAMS[e] for e in EXTRAS)])
        return f'''
def {info.name}({params}):
    """{info.name} as vLLM's fused MoE layer, routed externally: the block's own
    router (the source's) picks the experts and hands over their ids and weights."""
{guards}    state = TransformersMoEState()

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

    def loader(self, claim: Claim):
        return claim.spec[0].loader()


def _form(info: ClassInfo):
    """The first experts form that matches the class, or why none does."""
    for form in FORMS:
        found = form.match(info)
        if found is not None:
            return found
    raise PatternRefused(
        "their forward is not `act(gate) * up` on a stacked [gate; up] parameter, then "
        "one down projection, per expert, nor are they stacked [experts, hidden, 2 * "
        "intermediate] beside [experts, intermediate, hidden]"
    )


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


def _prove(model, info: ClassInfo, form, inst, seen):
    """(the form, as proven; the top-k expression over the experts' own constructor
    parameters), once the experts are proven to compute the fused form as their block
    calls them."""
    import copy

    import torch

    from ..dataflow import require_close

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
    module = copy.deepcopy(inst)

    def check(reference, hidden: int, scale: float = 1.0, tokens: int = 24):
        """The module's output against `reference`'s, on random inputs of `scale` and
        random routings (the module's own output, with `reference` None)."""
        gen = torch.Generator().manual_seed(11)
        n_experts = next(p for p in module.parameters() if p.dim() == 3).shape[0]
        with torch.no_grad():
            x = scale * torch.randn(tokens, hidden, generator=gen)
            chosen = torch.stack(
                [torch.randperm(n_experts, generator=gen)[:k] for _ in range(tokens)]
            ).to(ids.dtype)
            w = torch.rand(tokens, k, generator=gen)
            got = module(x, chosen, w)
            if reference is None:
                return got
            want = reference(x, chosen, w)
        require_close(got, want, f"{info.name} as FusedMoE with the source's routing")
        return got

    form = form.prove(model, info, module, check)
    return form, top_k


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
