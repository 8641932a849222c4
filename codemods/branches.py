"""Every kind of module the source can build, and the config switches that build it.

A tiny config built from a config class's defaults builds what the defaults build:
transformers' `Lfm2Config()` puts attention on every layer, so its short-convolution
layers would never be built, compared or scope-checked. This module reads the source
instead: every class a constructor names on any branch (`A(...) if cond else B(...)`,
`if cond: self.x = C(...)`), transitively from the causal LM, and for each, the
conditions on the way to it, with the config fields they read. `tiny.cover` uses the
conditions to pick values that build every kind (one layer on each side of every
per-layer switch), and `apply` refuses a source with a kind no tiny config builds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, ParentNodeProvider

from fusion_patterns.base import ClassInfo, code, dotted_name


@dataclass(frozen=True)
class Guard:
    """One condition on the way to a construction: `test` must be truthy (`negated`
    False) or falsy (`negated` True) for the call to run."""

    test: cst.BaseExpression
    negated: bool

    def describe(self) -> str:
        text = code(self.test)
        return f"not ({text})" if self.negated else text


@dataclass
class Site:
    """One place a class is built: the class whose `__init__` builds it, the guards."""

    owner: str
    guards: tuple[Guard, ...]
    # local names and `self.` attributes assigned earlier in the same `__init__`
    bindings: dict[str, cst.BaseExpression] = field(default_factory=dict)


def _bindings(init: cst.FunctionDef) -> dict[str, cst.BaseExpression]:
    """Name -> the expression last assigned to it in `init` (locals and `self.x`), so a
    guard `if self.is_attention_layer:` reads as the comparison it was set from."""
    out: dict[str, cst.BaseExpression] = {}
    for node in m.findall(init, m.Assign()):
        for target in node.targets:
            t = target.target
            if isinstance(t, cst.Name):
                out[t.value] = node.value
            elif m.matches(t, m.Attribute(value=m.Name("self"))):
                out[f"self.{t.attr.value}"] = node.value
    return out


def _sites_in(info: ClassInfo, classes: dict[str, ClassInfo]) -> dict[str, list[Site]]:
    """{class built in `info.__init__`: [sites]} with the guards of each call."""
    if info.init is None:
        return {}
    wrapper = MetadataWrapper(cst.Module(body=[info.init]), unsafe_skip_copy=True)
    parents = wrapper.resolve(ParentNodeProvider)
    bindings = _bindings(info.init)
    out: dict[str, list[Site]] = {}
    for call in m.findall(wrapper.module, m.Call()):
        name = dotted_name(call.func)
        if name not in classes:
            continue
        guards = []
        child, node = call, parents.get(call)
        while node is not None:
            if isinstance(node, cst.IfExp):
                if child is node.body:
                    guards.append(Guard(node.test, False))
                elif child is node.orelse:
                    guards.append(Guard(node.test, True))
            elif isinstance(node, cst.If):
                if child is node.body:
                    guards.append(Guard(node.test, False))
                elif child is node.orelse:
                    guards.append(Guard(node.test, True))
            elif isinstance(node, cst.Else) and isinstance(parents.get(node), cst.If):
                pass  # handled at the If: its orelse is this Else
            elif isinstance(node, cst.BooleanOperation):
                # `a and B(...)`: B is built when a is truthy; `a or B(...)`: when falsy
                if child is node.right:
                    guards.append(Guard(node.left, isinstance(node.operator, cst.Or)))
            child, node = node, parents.get(node)
        out.setdefault(name, []).append(Site(info.name, tuple(guards), bindings))
    return out


def constructible(classes: dict[str, ClassInfo], root: str) -> dict[str, list[Site]]:
    """{class: [sites]} of every class of the file a constructor reachable from `root`
    can build, on any branch (`root` itself with no sites)."""
    found: dict[str, list[Site]] = {root: []}
    stack = [root]
    while stack:
        name = stack.pop()
        info = classes.get(name)
        if info is None:
            continue
        for built, sites in _sites_in(info, classes).items():
            if built not in found:
                found[built] = []
                stack.append(built)
            found[built] += sites
    return found


def _params(info: ClassInfo) -> list[str]:
    if info.init is None:
        return []
    return [p.name.value for p in info.init.params.params if p.name.value != "self"]


def _passed(call: cst.Call, params: list[str], name: str) -> cst.BaseExpression | None:
    """The expression a construction call passes for parameter `name`."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg.value
    positional = [a.value for a in call.args if a.keyword is None and not a.star]
    index = params.index(name) if name in params else -1
    return positional[index] if 0 <= index < len(positional) else None


def caller_arguments(
    classes: dict[str, ClassInfo], owner: str
) -> dict[str, list[cst.BaseExpression]]:
    """{parameter of owner's __init__: the expressions its constructions pass for it}, so
    a guard on a parameter (`layer_type == "full_attention"`, with the caller passing
    `layer_type=config.layers_block_type[i]`) reads the config field behind it."""
    params = _params(classes[owner])
    inits = tuple(info.init for info in classes.values() if info.init is not None)
    out: dict[str, list[cst.BaseExpression]] = {}
    for call in _calls_by_callee(inits).get(owner, []):
        for p in params:
            value = _passed(call, params, p)
            if value is not None:
                out.setdefault(p, []).append(value)
    return out


@functools.lru_cache(maxsize=8)  # nodes hash by identity: one scan per set of classes
def _calls_by_callee(
    inits: tuple[cst.FunctionDef, ...],
) -> dict[str, list[cst.Call]]:
    out: dict[str, list[cst.Call]] = {}
    for init in inits:
        for call in m.findall(init, m.Call()):
            out.setdefault(dotted_name(call.func), []).append(call)
    return out


def site_fields(site: Site, classes: dict[str, ClassInfo]) -> list[list[str]]:
    """Per guard of `site`, the config fields it reads (through earlier bindings of its
    `__init__` and the arguments its callers pass); an empty list is a guard no config
    field decides (a constructor argument the caller fixes, `add_pooling_layer=False`).
    """
    passed = caller_arguments(classes, site.owner) if site.owner in classes else {}
    out = []
    for guard in site.guards:
        fields = config_fields(guard.test, site.bindings)
        for name in m.findall(guard.test, m.Name()):
            for value in passed.get(name.value, []):
                fields |= config_fields(value, {})
        out.append(sorted(fields))
    return out


def reachable_kinds(
    classes: dict[str, ClassInfo], root: str, built: set[str]
) -> dict[str, list[Site]]:
    """{class some config can build: its open sites}, from `root`, through every site
    whose guards each read a config field; a site a constructor argument fixes is
    followed only when the tiny model built its class."""
    from .fixed_arguments import FixedArguments

    sites = constructible(classes, root)
    is_open = {
        id(s): all(site_fields(s, classes)) for found in sites.values() for s in found
    }
    reached = {root}
    # what the constructions inside `reached` pass (it reads the set as it grows)
    fixed = FixedArguments(classes, reached)

    def taken(s: Site) -> bool:
        # a guard the constructions from what is reached decide against (Moshi's
        # depth-decoder linears, on the side its text model never passes)
        return s.owner in reached and is_open[id(s)] and not fixed.never_taken(s)

    changed = True
    while changed:
        changed = False
        for kind, found in sites.items():
            if kind in reached:
                continue
            if kind in built or any(taken(s) for s in found):
                reached.add(kind)
                changed = True
    return {
        kind: [s for s in found if taken(s)]
        for kind, found in sites.items()
        if kind in reached
    }


def config_fields(expr: cst.BaseExpression, bindings: dict) -> set[str]:
    """Config fields a guard reads (`config.x`, `self.config.x`, `getattr(config, "x")`,
    through the names its `__init__` bound earlier)."""
    out: set[str] = set()
    seen: set[str] = set()

    def walk(node: cst.BaseExpression) -> None:
        for attr in m.findall(node, m.Attribute()):
            inner = attr.value
            if m.matches(inner, m.Name("config")) or m.matches(
                inner, m.Attribute(value=m.Name("self"), attr=m.Name("config"))
            ):
                out.add(attr.attr.value)
        for call in m.findall(
            node,
            m.Call(
                func=m.Name("getattr"),
                args=[m.Arg(), m.Arg(m.SimpleString()), m.ZeroOrMore()],
            ),
        ):
            out.add(call.args[1].value.evaluated_value)
        for name in m.findall(node, m.Name() | m.Attribute(value=m.Name("self"))):
            key = (
                name.value if isinstance(name, cst.Name) else f"self.{name.attr.value}"
            )
            if key in bindings and key not in seen:
                seen.add(key)
                walk(bindings[key])

    walk(expr)
    return out


def guard_fields(sites: list[Site], classes: dict[str, ClassInfo]) -> list[str]:
    """The config fields read by the guards of any site, in order of appearance."""
    out: list[str] = []
    for site in sites:
        for fields in site_fields(site, classes):
            out += [f for f in fields if f not in out]
    return out


def compared_literals(module: cst.Module, fields: set[str]) -> dict[str, list]:
    """{field: literal values it is compared with or indexed against in `module`}:
    `config.layer_types[i] == "full_attention"` gives layer_types ["full_attention"]."""
    out: dict[str, list] = {}
    for comp in m.findall(module, m.Comparison()):
        names = config_fields(comp, {})
        hits = names & fields
        if not hits:
            continue
        for lit in m.findall(comp, m.SimpleString() | m.Integer()):
            value = (
                lit.evaluated_value
                if isinstance(lit, cst.SimpleString)
                else int(lit.value)
            )
            for f in hits:
                out.setdefault(f, [])
                if value not in out[f]:
                    out[f].append(value)
    return out


def strings(module: cst.Module) -> list[str]:
    """Identifier-like string literals of a module, in order of appearance: the values a
    per-layer type list may take (`"conv"` beside `"full_attention"` in Lfm2Config)."""
    out: list[str] = []
    for lit in m.findall(module, m.SimpleString()):
        try:
            value = lit.evaluated_value
        except Exception:  # noqa: BLE001 - bytes or odd prefixes
            continue
        if (
            isinstance(value, str)
            and value.replace("_", "").isalnum()
            and value not in out
        ):
            out.append(value)
    return out


# What a layer may do with the cache transformers hands it and still be served by vLLM's
# paged KV cache: store and read keys and values (and the sparse indexer's keys, which
# the attention refusals decide on). Anything else is state across decode steps.
KV_CACHE_USES = {
    "update",
    "get_seq_length",
    "get_mask_sizes",
    "is_updated",
    "self_attention_cache",
    "cross_attention_cache",
    "is_compileable",
    "get_max_cache_shape",
    "update_indexer",
}
CACHE_NAMES = {"past_key_values", "past_key_value", "cache_params", "layer_past"}


def convolution(info: ClassInfo) -> str | None:
    """The convolution over the sequence `info` builds (`nn.Conv1d`), or None."""
    if info.init is not None:
        for call in m.findall(info.init, m.Call()):
            name = dotted_name(call.func) or ""
            if name.split(".")[-1] in ("Conv1d", "CausalConv1d"):
                return name
    return None


def kept_state(info: ClassInfo) -> str | None:
    """What `info` keeps across decode steps besides the KV cache, or None: a
    convolution over the sequence (its last inputs carry over), or a use of the cache
    beyond storing keys and values (`past_key_values.update_conv_state`)."""
    conv = convolution(info)
    if conv:
        return f"a convolution over the sequence ({conv})"
    for method in info.node.body.body:  # every method: helpers the forward calls too
        if not isinstance(method, cst.FunctionDef) or method.name.value == "__init__":
            continue
        for attr in m.findall(method, m.Attribute(value=m.Name())):
            if attr.value.value in CACHE_NAMES and attr.attr.value not in KV_CACHE_USES:
                return f"`{attr.value.value}.{attr.attr.value}` (state in the cache)"
    return None
