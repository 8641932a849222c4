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

import libcst as cst
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
from . import flattened, glu, transposed

# the experts forms, in the order they are tried
FORMS = (glu, transposed, flattened)

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
                form = _form(info, model.classes)
                form, top_k = _prove(model, info, form, inst, seen)
            except Exception as exc:
                yield refused_by(exc, NAME, n, WHAT)
                continue
            # vLLM's fused layer takes [tokens, hidden]: hidden states the block hands
            # with more dims (DBRX's [batch, tokens, hidden]) are flattened at the call
            flatten = _handed(seen)[0].dim() > 2
            yield Claim(
                self,
                n,
                (form, top_k, flatten),
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
        form, top_k, _ = claim.spec
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

    def call_site(self, claim: Claim, call: cst.Call) -> cst.BaseExpression | None:
        if not claim.spec[2]:
            return None
        x = code(call.args[0].value)  # a name: checked when claimed
        flat = call.with_changes(
            args=[
                call.args[0].with_changes(
                    value=cst.parse_expression(f"{x}.reshape(-1, {x}.shape[-1])")
                ),
                *call.args[1:],
            ]
        )
        return cst.parse_expression(f"{code(flat)}.view_as({x})")


def _form(info: ClassInfo, classes):
    """The first experts form that matches the class, or why none does."""
    for form in FORMS:
        found = form.match(info, classes)
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
        if _handed(seen)[0].dim() > 2 and not isinstance(
            calls[0].args[0].value, cst.Name
        ):
            raise PatternRefused(
                f"{owner.name} hands them [batch, tokens, hidden] states computed in "
                "the call (vLLM's fused layer takes them flat)"
            )
    ids = _handed(seen)[1]
    k = ids.shape[-1]
    config, base = _experts_config(model, info)
    top_k = _top_k(model, info, k, config, base)
    module = copy.deepcopy(inst)

    # the hidden states as the block hands them (DBRX: [batch, tokens, hidden])
    lead = tuple(_handed(seen)[0].shape[:-1])

    def check(reference, hidden: int, n_experts: int, scale: float = 1.0):
        """The module's output against `reference`'s, on random inputs of `scale`,
        shaped as the block hands them, and random routings over `n_experts` (the
        module's own output, with `reference` None)."""
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            x = scale * torch.randn(*lead[:-1], 24, hidden, generator=gen)
            flat = x.reshape(-1, hidden)
            chosen = torch.stack(
                [torch.randperm(n_experts, generator=gen)[:k] for _ in flat]
            ).to(ids.dtype)
            w = torch.rand(flat.shape[0], k, generator=gen)
            got = module(x, chosen, w)
            if reference is None:
                return got
            want = reference(flat, chosen, w).view(x.shape)
        if got.shape != x.shape:
            # vLLM's fused layer returns its input's shape
            raise PatternRefused(
                f"they return {tuple(got.shape)} for {tuple(x.shape)} hidden states"
            )
        require_close(got, want, f"{info.name} as FusedMoE with the source's routing")
        return got

    form = form.prove(config, info, module, check)
    return form, top_k


def _experts_config(model, info: ClassInfo):
    """(the config object the experts are built with, its expression in their block):
    the model's config, or a sub-config of it (DBRX's `config.ffn_config`)."""
    from ..moe.proof import evaluate

    bases = set()
    for owner, attr in _owners(model, info.name):
        call = owner.attrs[attr]
        args = [a.value for a in call.args if a.keyword is None] + [
            a.value for a in call.args if a.keyword and a.keyword.value == "config"
        ]
        if not args:
            raise PatternRefused(f"{owner.name} builds them without a config")
        bases.add(code(args[0]))
    if len(bases) != 1:
        raise PatternRefused(f"their blocks build them from {sorted(bases)}")
    base = bases.pop()
    if not base.startswith("config"):
        raise PatternRefused(f"their block builds them from `{base}`, not its config")
    return evaluate(cst.parse_expression(base), model.config, "their config"), base


def _top_k(model, info: ClassInfo, k: int, config, base: str) -> str:
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
            read |= {
                n.attr.value
                for n in m.findall(cls.node, m.Attribute())
                if _reads_config(n.value, base)
            }
            as_k |= set(_topk_fields(cls, base))
    fields = {
        name
        for name in read
        if type(getattr(config, name, None)) is int and getattr(config, name) == k
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


_TOPK = m.Call(func=m.Attribute(attr=m.Name("topk")) | m.Name("topk"))


def _topk_fields(info: ClassInfo, base: str):
    """The fields of `base` (the experts' config) a `topk` call of `info` takes as its
    k, through `self.<attr>`."""
    for call in m.findall(info.node, _TOPK):
        keyword = [a.value for a in call.args if a.keyword and a.keyword.value == "k"]
        positional = [a.value for a in call.args if a.keyword is None]
        for value in keyword or positional[1:2]:
            if m.matches(value, m.Attribute(value=m.Name("self"))):
                value = info.attrs.get(value.attr.value)
            if isinstance(value, cst.Attribute) and _reads_config(value.value, base):
                yield value.attr.value


def _reads_config(node: cst.BaseExpression, base: str) -> bool:
    """`config.<field>`, or `self.config.<field>` in a module built from `config`
    (Gemma 4's router reads its top-k so)."""
    return code(node) in (base, f"self.{base}")
