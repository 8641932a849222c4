"""Tiny configs that build every kind of module the source can build.

`branches.reachable_kinds` says which classes some config can build and under which
conditions; this searches config values that build each of them, starting from the
tiny values (`tiny.working_values`): one layer on each side of every per-layer switch
(`layer_types`, `mlp_layer_types`, a dense-layer count, a sparse step), a config-wide
switch on where the class needs it (`shared_intermediate_size > 0`). A class the primary
config cannot also build without losing another (an RMSNorm or a LayerNorm by
`rms_norm_eps`) gets a second config. A class no candidate builds is reported unbuilt:
`apply` refuses the source rather than verify the rest.

Candidates are values read from the source, not per model: the literals a field is
compared with, the strings the configuration module writes beside its known values,
transformers' own layer-type vocabularies, thresholds over the layer indices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo

from . import branches

MAX_LAYERS = 8  # a layer added for a kind the others cannot make room for, up to this
MAX_VARIANTS = 3
SIZE = 128  # a tiny size for a size field a class needs non-zero


@dataclass
class Cover:
    """The tiny configs (the first is the primary: the one `apply` probes) and what each
    builds."""

    variants: list[dict]
    built: list[set[str]]
    kinds: dict[str, list[branches.Site]]  # every class some config can build
    unbuilt: dict[str, str] = field(default_factory=dict)  # class -> its condition

    @property
    def primary(self) -> dict:
        return self.variants[0]

    def all_built(self) -> set[str]:
        return set().union(*self.built)


def built_classes(causal_cls, values: dict) -> set[str] | None:
    """Names of the module classes `values` build (on the meta device, where building
    costs nothing), or None if the model cannot be built."""
    import torch

    try:
        config = causal_cls.config_class(**values)
        config._attn_implementation = "eager"
        try:
            with torch.device("meta"):
                model = causal_cls(config)
        except Exception:  # noqa: BLE001 - an __init__ that computes on real tensors
            model = causal_cls(config)
    except Exception:  # noqa: BLE001 - the config or the model rejects these values
        return None
    return {type(x).__name__ for x in model.modules()}


def _layers_field(config) -> str | None:
    for name in ("num_hidden_layers", "num_layers", "n_layer", "n_layers"):
        if isinstance(getattr(config, name, None), int):
            return name
    return None


def _per_layer_lists(config, n: int) -> list[str]:
    return [
        k
        for k, v in config.to_dict().items()
        if isinstance(v, list) and len(v) == n and not k.startswith("_") and n > 1
    ]


def _configuration_module(causal_cls) -> cst.Module | None:
    import inspect

    try:
        return cst.parse_module(
            inspect.getsource(inspect.getmodule(causal_cls.config_class))
        )
    except Exception:  # noqa: BLE001 - no source to read
        return None


def _siblings(module: cst.Module | None, known: list) -> list[str]:
    """Strings written in one expression with a known value (`"full_attention" if ...
    else "conv"`, a list or dict of layer types)."""
    if module is None:
        return []
    out: list[str] = []
    groups = m.findall(
        module,
        m.IfExp() | m.List() | m.Tuple() | m.Set() | m.Dict() | m.Comparison(),
    )
    for node in groups:
        found = []
        for lit in m.findall(node, m.SimpleString()):
            try:
                found.append(lit.evaluated_value)
            except Exception:  # noqa: BLE001
                continue
        if any(v in known for v in found):
            out += [
                v
                for v in found
                if isinstance(v, str)
                and v.replace("_", "").isalnum()
                and v not in known
                and v not in out
            ]
    return out


def _vocabulary(name: str) -> list[str]:
    """transformers' own vocabulary of layer types for a per-layer list."""
    from transformers import configuration_utils as cu

    if "mlp" in name:
        return list(getattr(cu, "ALLOWED_MLP_LAYER_TYPES", ()))
    return list(getattr(cu, "ALLOWED_ATTN_LAYER_TYPES", ()))


class _Candidates:
    """Value changes to try for a class, from the fields its guards read."""

    def __init__(self, causal_cls, source_module: cst.Module, classes):
        self.causal_cls = causal_cls
        self.source_module = source_module
        self.classes = classes
        self.config_module = _configuration_module(causal_cls)

    def literals(self, name: str, current) -> list:
        compared = branches.compared_literals(self.source_module, {name}).get(name, [])
        if self.config_module is not None:
            compared += [
                v
                for v in branches.compared_literals(self.config_module, {name}).get(
                    name, []
                )
                if v not in compared
            ]
        known = list(
            dict.fromkeys(
                [*compared, *(current if isinstance(current, list) else [current])]
            )
        )
        out = list(dict.fromkeys(compared))
        out += [v for v in _siblings(self.config_module, known) if v not in out]
        if isinstance(current, list) and all(isinstance(v, str) for v in current):
            out += [v for v in _vocabulary(name) if v not in out]
        return out

    def for_kind(self, sites: list[branches.Site], values: dict):
        """Yield changed copies of `values`."""
        config = self.causal_cls.config_class(**values)
        layers = _layers_field(config)
        n = getattr(config, layers) if layers else 1
        for name in branches.guard_fields(sites, self.classes):
            current = getattr(config, name, None)
            if isinstance(current, list) and len(current) == n and n > 1:
                yield from self._per_layer(values, config, name, current, layers, n)
            elif isinstance(current, list):  # layer indices (`mlp_only_layers`)
                for j in range(n):
                    yield _set(values, name, [j])
                yield _set(values, name, [])
            else:
                yield from self._scalar(values, name, current, n)

    def _per_layer(self, values, config, name, current, layers, n):
        for value in self.literals(name, current):
            for j in range(n):
                if current[j] != value:
                    yield _set(values, name, [*current[:j], value, *current[j + 1 :]])
            if n < MAX_LAYERS:  # one more layer of this kind, every list kept in step
                out = json.loads(json.dumps(values))
                for other in _per_layer_lists(config, n):
                    seq = list(getattr(config, other))
                    out[other] = [*seq, value if other == name else seq[-1]]
                out[layers] = n + 1
                yield out

    def _scalar(self, values, name, current, n):
        tried = []
        options = self.literals(name, current)
        if (
            isinstance(current, int)
            and not isinstance(current, bool)
            or current is None
        ):
            counts = list(range(n + 1)) + [2]
            options += [SIZE, *counts] if "size" in name else counts
        if current is None or isinstance(current, float):
            options += [1e-6]
        options += [True, False, None]
        for value in options:
            if value == current or value in tried:
                continue
            tried.append(value)
            yield _set(values, name, value)


def _set(values: dict, name: str, value) -> dict:
    out = json.loads(json.dumps(values))
    out[name] = value
    return out


def _runs(causal_cls, values) -> bool:
    from . import tiny

    try:
        tiny.check_runs(causal_cls, values)
        return True
    except Exception:  # noqa: BLE001 - the source's own failure on these values
        return False


def _modules(causal_cls, kinds: dict) -> dict:
    """Only the nn.Module classes (a config or output dataclass is no layer kind)."""
    import sys

    import torch.nn as nn

    pymodule = sys.modules[causal_cls.__module__]
    return {
        k: v
        for k, v in kinds.items()
        if isinstance(getattr(pymodule, k, None), type)
        and issubclass(getattr(pymodule, k), nn.Module)
    }


def cover(
    causal_cls, source_module: cst.Module, classes: dict[str, ClassInfo], values: dict
) -> Cover:
    """Tiny configs from `values` (already working) that build every reachable kind."""
    primary = values
    built = built_classes(causal_cls, primary) or set()
    kinds = _modules(
        causal_cls, branches.reachable_kinds(classes, causal_cls.__name__, built)
    )
    variants, builts = [primary], [built]
    candidates = _Candidates(causal_cls, source_module, classes)
    unbuilt: dict[str, str] = {}
    for kind, sites in kinds.items():
        if kind in set().union(*builts) or kind not in classes:
            continue
        found = False
        second = None
        for trial in candidates.for_kind(sites, variants[0]):
            got = built_classes(causal_cls, trial)
            if got is None or kind not in got:
                continue
            if got >= builts[0] and _runs(causal_cls, trial):
                variants[0], builts[0] = trial, got
                found = True
                break
            if (
                second is None
                and len(variants) < MAX_VARIANTS
                and _runs(causal_cls, trial)
            ):
                second = (trial, got)
        if not found and second is not None:
            variants.append(second[0])
            builts.append(second[1])
            found = True
        if not found:
            unbuilt[kind] = (
                " or ".join(
                    " and ".join(g.describe() for g in s.guards) or "(always)"
                    for s in sites
                )
                or "(never)"
            )
    # kinds that only a later config made reachable are checked on the next apply
    return Cover(variants=variants, built=builts, kinds=kinds, unbuilt=unbuilt)


def for_source(causal_cls, source):
    """The Cover of a modeling file's causal LM, or None where its tiny model does
    not run (the tiers say why)."""
    from . import tiny

    try:
        values = tiny.working_values(causal_cls)
    except Exception:  # noqa: BLE001 - reported by the tier that needs it
        return None
    return cover(causal_cls, source.module, source.classes, values)


def _inside_attention(sites: list[branches.Site], classes) -> bool:
    """Every class building it calls transformers' attention interface (an indexer)."""
    from .attention_calls import interface_call

    owners = [classes.get(s.owner) for s in sites]
    return bool(owners) and all(
        o is not None and o.forward is not None and interface_call(o.forward)
        for o in owners
    )


def refuse_unservable(causal_cls, found: Cover, classes: dict[str, ClassInfo]) -> None:
    """Raise for a kind the toolkit cannot serve or cannot verify: a layer that keeps
    state across decode steps besides the KV cache (out of scope), a kind no tiny
    config builds, an attention class only a second config builds (the probe runs the
    first)."""
    import sys

    from transformers import PreTrainedModel

    from fusion_patterns.registry import mapped_state_kinds, state_patterns

    from . import vllm_native
    from .errors import CodemodError

    # (an encoder-decoder model is out of scope before this: `probe.refuse_out_of_scope`)
    pymodule = sys.modules[causal_cls.__module__]
    for kind in found.kinds:
        obj = getattr(pymodule, kind, None)
        if isinstance(obj, type) and issubclass(obj, PreTrainedModel):
            continue  # the base model and the causal LM: their forward is vLLM's
        why = branches.kept_state(classes[kind])
        # a convolution is a state cache's job wherever it sits (ZAYA's q/k mixing)
        selects = not branches.convolution(classes[kind])
        if why and selects and _inside_attention(found.kinds[kind], classes):
            raise CodemodError(
                vllm_native.unmapped(
                    causal_cls.__name__,
                    f"{kind}, inside the attention, keeps its own state in the cache "
                    f"({why}): a sparse selection vLLM's Attention cannot take",
                )
            )
        if why and state_patterns(classes[kind]):
            continue  # its pattern's claim proves it, or says why not
        if why:
            raise CodemodError(
                vllm_native.unmapped(
                    causal_cls.__name__,
                    f"{kind} keeps state across decode steps besides the KV cache "
                    f"({why}), which vLLM keeps only in its own state cache",
                    kind,
                    ", ".join(mapped_state_kinds()),
                )
            )
    for kind, condition in found.unbuilt.items():
        raise CodemodError(
            f"cannot generate: no tiny config builds {kind} (built when {condition}), "
            "so it could be neither proven nor verified"
        )
    from .attention_calls import interface_call

    for kind in found.all_built() - found.built[0]:
        info = classes.get(kind)
        if (
            info is not None
            and info.forward is not None
            and interface_call(info.forward)
        ):
            raise CodemodError(
                f"cannot generate: the attention class {kind} is built only by a second "
                "tiny config, and the proofs run on the first"
            )


def refuse_unclaimed_state(found: Cover | None, model) -> None:
    """A kind that keeps state, left to the claims by `refuse_unservable` because a
    pattern maps it, and not claimed: the copy would keep transformers' cache."""
    from fusion_patterns.registry import state_patterns

    from . import vllm_native
    from .errors import CodemodError

    # the kinds the source can build and those the tiny model built (a kind the rules
    # over layer types cannot read, such as a mixer picked from a dict, is still seen)
    kinds = set(found.kinds if found is not None else ()) | set(model.probe.instances)
    for kind in sorted(kinds):
        info = model.classes.get(kind)
        if info is None or model.claimed_whole(kind) or not branches.kept_state(info):
            continue
        mapping = state_patterns(info)
        if not mapping:
            continue  # the causal LM and the base model: their forward is vLLM's
        why = next(
            (
                r.reason
                for r in model.refusals
                if r.source_class == kind and r.pattern in mapping
            ),
            "its pattern did not run",
        )
        arch = model.roles.causal.name
        native = vllm_native.serves(vllm_native.native(arch), arch)
        raise CodemodError(
            f"cannot generate: {kind} keeps state across decode steps besides the KV "
            f"cache, and its mapping onto vLLM's state cache is not proven ({why})"
            + (f"; {native}" if native else "")
        )
