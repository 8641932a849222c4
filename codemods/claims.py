"""Stage 4: the registry loop. Each pattern, in `fusion_patterns.registry` order, claims
the parts of the model it proves (a whole class, the constructions of a class, or a
rewrite of a copied class) and says why it refused the candidates it did not prove.
Fusion is per part: a refusal costs that part its fused form, never the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fusion_patterns.base import CLASS, CONSTRUCTION, Claim, ClassInfo, Refusal
from fusion_patterns.registry import PATTERNS
from fusion_patterns.rms_norm import NAME as RMS_NORM
from fusion_patterns.rms_norm import match as norm_match

from .probe import Probe
from .roles import Roles
from .source import ModelSource

# torch's own norms: kept as they are, but a norm all the same (a q/k norm, a post-norm)
TORCH_NORMS = {"nn.LayerNorm", "torch.nn.LayerNorm"}


@dataclass(frozen=True)
class ShardedWays:
    """Where a class's tensor-parallel plan holds, over the ways its config branches go:
    `where` is "" on every way, a config test (as `__init__` reads it) on the ways
    proven, whole on every rank elsewhere, or None on no way; `note` says so in the
    report ("" when sharded everywhere)."""

    where: str | None
    note: str

    @property
    def disable_tp(self) -> str | None:
        """The `disable_tp=` of the class's vLLM linears; None: sharded everywhere."""
        from .copying.config_branches import negated

        if self.where is None:
            return "True"
        return negated(self.where) if self.where else None


@dataclass
class Model:
    """The model as the stages before the claims found it, and the claims so far: what
    a pattern's `claim` reads."""

    source: ModelSource
    pymodule: object
    config: object
    probe: Probe
    roles: Roles
    # transformers' `base_model_tp_plan`, per class: {linear attr: style}
    tp_plan: dict[str, dict[str, str]]
    # linear attributes whose `.weight`/`.bias` the source reads: kept as nn.Linear
    kept_linears: set[str]
    # class -> linears it reads as weights only on a branch its config decides
    branch_reads: dict = field(default_factory=dict)
    claims: list[Claim] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    # class node -> whether it looks like a norm: the patterns ask again and again
    _norm_like: dict = field(default_factory=dict, repr=False)

    @property
    def classes(self) -> dict[str, ClassInfo]:
        return self.source.classes

    def first(self, cls: str):
        """The first instance of `cls` in the tiny model, or None."""
        return self.probe.first(cls)

    def call(self, instance):
        """(args, kwargs, output) of `instance`'s first call in the probe, or None."""
        return self.probe.module_calls.get(id(instance))

    def folded(self, cls: str) -> ClassInfo:
        """`cls` with its forward as the copy emits it: the parameters vLLM never
        passes (a cache, a cross-attention's states) folded to their values, so a
        pattern reads the path the generated file runs."""
        from dataclasses import replace

        from .copying.inference import inference_folded

        info = self.classes[cls]
        if info.forward is None:
            return info
        return replace(info, forward=inference_folded(info.forward))

    def inference_args(self, cls: str) -> dict:
        """{parameter of `cls`'s forward vLLM never passes: the value it always has}
        (what `folded` folds), for a trace of the path the generated file runs."""
        import ast

        from .copying.inference import inference_values

        values = inference_values(self.classes[cls].forward)
        return {k: ast.literal_eval(v) for k, v in values.items()}

    def other_ways(self, cls: str, instance, call):
        """`cls` rebuilt on each other way its config branches go
        (`other_branches.other_branches`), but a branch reading weights as tensors,
        which the module checks when it is built; None where one cannot be read."""
        from .copying.other_branches import other_branches

        settled = self.branch_reads.get(cls)
        return other_branches(
            self.classes[cls],
            instance,
            call,
            self.config,
            settled and settled.init_test,
        )

    def sharded_ways(
        self, cls: str, kind, plan, prove, tiny_failure: str | None = None
    ) -> "ShardedWays":
        """Where `plan` shards `cls` over the ways its config branches go: `kind` is
        (an instance, its call), `prove(other)` runs the proof on one other way,
        `tiny_failure` says why it fails on the tiny config's own way (None: it holds
        there)."""
        from .copying.other_branches import UNREAD_BRANCHES

        branches = self.other_ways(cls, *kind)
        if branches is None:
            return ShardedWays(None, f"replicated: {tiny_failure or UNREAD_BRANCHES}")
        failed = branches.failures(plan, prove)
        if tiny_failure is None:
            if not failed:
                return ShardedWays("", "")
            taken = branches.pinned(set(failed))
            first = failed[min(failed, key=len)]
            return ShardedWays(
                taken,
                f"sharded where `{taken}` (proven there), whole on every rank "
                f"elsewhere: {first}",
            )
        ways = [o for o in branches.others if o.flipped not in failed]
        if not ways:
            return ShardedWays(None, f"replicated: {tiny_failure}")
        taken = branches.any_of([o.flipped for o in ways])
        there = tiny_failure.removeprefix("sharded ")
        return ShardedWays(
            taken,
            f"sharded where `{taken}` (proven with {ways[0].label}), whole on every "
            f"rank elsewhere (the tiny config's way: {there})",
        )

    def claimed_whole(self, cls: str) -> bool:
        return any(
            c.class_name == cls and c.kind in (CLASS, CONSTRUCTION) for c in self.claims
        )

    def refused(self, cls: str) -> bool:
        return any(r.source_class == cls for r in self.refusals)

    def norm_specs(self) -> dict:
        """{norm class: its spec} of the norms claimed so far (every construction of
        them is vLLM's norm)."""
        # a stateful mixer is claimed per construction too: not a norm
        return {
            c.class_name: c.spec
            for c in self.claims
            if c.kind == CONSTRUCTION and c.pattern.name == RMS_NORM
        }

    def norm_classes(self) -> dict:
        """Every class that computes a norm, proven or not -> its spec (None for a norm
        kept as the source has it)."""
        like = {n for n, info in self.classes.items() if self._norm_like_class(info)}
        return {**{n: None for n in like | TORCH_NORMS}, **self.norm_specs()}

    def _norm_like_class(self, info: ClassInfo) -> bool:
        if info.node not in self._norm_like:
            self._norm_like[info.node] = norm_match(info) is not None
        return self._norm_like[info.node]

    def sublayer_candidates(self) -> list[str]:
        """Classes inside a decoder layer that are neither the layer nor its attention,
        nor claimed yet: the blocks (MLPs, MoE blocks) the patterns may take."""
        r = self.roles
        skip = set(r.attention) | set(r.layer_classes) | {r.causal.name, r.base.name}
        return [
            n
            for n in r.wanted
            if n in r.in_layers and n not in skip and not self.claimed_whole(n)
        ]


def run(model: Model, disabled: frozenset[str] = frozenset()) -> Model:
    """Every pattern's claims and refusals, in registry order (a class claimed whole is
    not offered to the patterns after it); `disabled` patterns are not run."""
    for pattern in PATTERNS:
        if pattern.name in disabled:
            continue
        for found in pattern.claim(model):
            if isinstance(found, Refusal):
                model.refusals.append(found)
            elif not model.claimed_whole(found.class_name) or found.kind not in (
                CLASS,
                CONSTRUCTION,
            ):
                model.claims.append(found)
    return model


def tp_plan(config, model, base_attr: str, classes) -> dict[str, dict[str, str]]:
    """{class: {linear attr: style}} from the config class's `base_model_tp_plan`; a
    class used under paths the plan shards differently is replicated."""
    import fnmatch

    import torch.nn as nn

    plan = (
        getattr(type(config), "base_model_tp_plan", None)
        or getattr(config, "base_model_tp_plan", None)
        or {}
    )
    seen: dict[str, dict[str, set[str]]] = {}
    for path, mod in getattr(model, base_attr).named_modules():
        cls = type(mod).__name__
        if cls not in classes:
            continue
        for attr, child in mod.named_children():
            if not isinstance(child, nn.Linear):
                continue
            full = f"{path}.{attr}" if path else attr
            style = "replicate"
            for pattern, s in plan.items():
                if fnmatch.fnmatchcase(
                    full, pattern.replace("*", "[0-9]*")
                ) or fnmatch.fnmatchcase(full, pattern):
                    style = s
                    break
            seen.setdefault(cls, {}).setdefault(attr, set()).add(style)
    out: dict[str, dict[str, str]] = {}
    known = {"colwise", "rowwise", "colwise_gather_output", "rowwise_split_input"}
    for cls, attrs in seen.items():
        if any(len(s) > 1 for s in attrs.values()):
            continue  # sharded in one place, not in another: replicated everywhere
        styles = {a: next(iter(s)) for a, s in attrs.items()}
        if all(s in known or s == "replicate" for s in styles.values()):
            out[cls] = {a: s for a, s in styles.items() if s in known}
    return out


def pattern_names() -> list[str]:
    return [p.name for p in PATTERNS]
