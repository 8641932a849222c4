"""The source's rotary code in a copied attention -> vLLM's rope (`get_rope`).

Where the attention is copied (no pattern claimed it whole), the statement
`q, k = apply_rotary_pos_emb(q, k, cos, sin)` that reads the tables the layer was handed
(`cos, sin = position_embeddings`) becomes vLLM's rope on vLLM's positions:
`self.rotary_emb = get_rope(...)` at the end of `__init__`, the statement
`q, k = self._vllm_rope(positions, q, k)`. Proven on every layer of the tiny model that
runs it, against what the source's function returns there: the `get_rope` the file
builds (head size, rotated dims, NeoX halves or GPT-J pairs, the config's rope
parameters, per layer type where the source keeps one rope each), read from the same
expressions the generated `__init__` evaluates; and once more with every rope theta of
the config changed, the source's rotary module rebuilt from it, so a source that does
not read its rope from `config.rope_parameters` is never taken for one that does. A
function that never ran in the tiny model stays as the source has it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from .base import REWRITE, Claim, FusionRecord, Pattern, PatternRefused, Refusal, code
from .emitting import DefaultNone, with_keyword

NAME = "rope"
WHAT = "rotary embedding"
MAX_POSITION = "config.max_position_embeddings"
# the rope parameters `get_rope` reads: the config's, or one per layer type (Gemma 3)
ROPE_EXPRESSIONS = (
    "config.rope_parameters",
    "config.rope_parameters[config.layer_types[layer_idx]]",
)
METHOD = """
    def _vllm_rope(self, positions, query, key):
        # vLLM's rope takes [tokens, heads * head size]; the source holds
        # {layout}
        tokens = positions.shape[-1]
        q, k = (t{to_tokens}.reshape(tokens, -1) for t in (query, key))
        q, k = self.{attr}(positions, q, k)
        return tuple(
            r.view(t{shape}){from_tokens} for r, t in ((q, query), (k, key))
        )
"""
LAYOUTS = {  # the source's token axis -> (layout, to tokens first, shape, back)
    1: ("[1, tokens, heads, head size]", "", ".shape", ""),
    2: (
        "[1, heads, tokens, head size]",
        ".transpose(1, 2)",
        ".transpose(1, 2).shape",
        ".transpose(1, 2)",
    ),
}


@dataclass
class RopeSpec:
    """One copied attention's proven rope: the functions replaced, and the
    `get_rope` the generated `__init__` builds."""

    functions: dict[str, int]  # function name -> the token axis of its q and k
    tables: tuple[str, str]  # the names the layer's tables are unpacked to
    param: str  # the forward parameter holding the tables
    head: str
    rope: str
    rope_dim: str | None
    neox: bool
    attr: str
    unrun: list[str] = field(default_factory=list)
    # the forward no longer reads the tables: callers stop handing them
    drop: bool = False


def _calls(forward: cst.FunctionDef) -> tuple[str, tuple[str, str], list[cst.Call]]:
    """(param, (cos, sin), the calls `f(q, k, cos, sin, ...)` bound to two names) in a
    forward that unpacks one of its parameters into two tables."""
    params = {p.name.value for p in forward.params.params} | {
        p.name.value for p in forward.params.kwonly_params
    }
    unpacks = [
        a
        for a in m.findall(
            forward.body,
            m.Assign(
                targets=[
                    m.AssignTarget(m.Tuple([m.Element(m.Name()), m.Element(m.Name())]))
                ],
                value=m.Name(),
            ),
        )
        if a.value.value in params
    ]
    for unpack in unpacks:
        cos, sin = (e.value.value for e in unpack.targets[0].target.elements)
        calls = [
            a.value
            for a in m.findall(
                forward.body,
                m.Assign(
                    targets=[
                        m.AssignTarget(
                            m.Tuple([m.Element(m.Name()), m.Element(m.Name())])
                        )
                    ],
                    value=m.Call(
                        func=m.Name(),
                        args=[
                            m.Arg(keyword=None),
                            m.Arg(keyword=None),
                            m.Arg(m.Name(cos), keyword=None),
                            m.Arg(m.Name(sin), keyword=None),
                            m.ZeroOrMore(),
                        ],
                    ),
                ),
            )
        ]
        if calls:
            return unpack.value.value, (cos, sin), calls
    return "", ("", ""), []


class Rope(Pattern):
    name = NAME
    rewrites_calls = True

    def claim(self, model):
        for n, attention in model.roles.attention.items():
            info = model.classes[n]
            if model.claimed_whole(n) or info.forward is None:
                continue
            param, tables, calls = _calls(info.forward)
            if not calls:
                continue
            try:
                spec = _prove(model, n, param, tables, calls)
            except PatternRefused as why:
                yield Refusal(NAME, n, WHAT, str(why))
                continue
            except Exception as exc:  # a proof that cannot run is a refusal
                text = str(exc).splitlines()[0] if str(exc) else ""
                yield Refusal(
                    NAME, n, WHAT, f"proof failed to run: {type(exc).__name__}: {text}"
                )
                continue
            style = "NeoX halves" if spec.neox else "GPT-J pairs"
            yield Claim(
                self,
                n,
                spec,
                REWRITE,
                records=[
                    FusionRecord(
                        NAME,
                        n,
                        tuple(spec.functions),
                        spec.attr,
                        "get_rope",
                        detail=style,
                    )
                ],
                needs_positions=True,
            )
            for f in spec.unrun:
                yield Refusal(
                    NAME,
                    n,
                    f"{WHAT} {f}",
                    "never runs in the tiny model: kept as the source",
                )

    def rewrite_class(self, claim: Claim, node: cst.ClassDef) -> cst.ClassDef:
        spec: RopeSpec = claim.spec
        body = []
        for stmt in node.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                stmt = stmt.with_changes(
                    body=stmt.body.with_changes(
                        body=[*stmt.body.body, cst.parse_statement(_construction(spec))]
                    )
                )
            elif isinstance(stmt, cst.FunctionDef) and stmt.name.value == "forward":
                stmt = _rewrite_forward(stmt, spec)
            body.append(stmt)
        axis = next(iter(spec.functions.values()))
        layout, to_tokens, shape, back = LAYOUTS[axis]
        method = METHOD.format(
            layout=layout,
            to_tokens=to_tokens,
            shape=shape,
            from_tokens=back,
            attr=spec.attr,
        )
        body.append(cst.parse_module(_dedent(method)).body[0])
        return node.with_changes(body=node.body.with_changes(body=body))

    def call_site(self, claim: Claim, call: cst.Call) -> cst.BaseExpression | None:
        spec: RopeSpec = claim.spec
        args = [
            a
            for a in call.args
            if a.keyword is None or a.keyword.value != spec.param or not spec.drop
        ]
        if len(args) != len(call.args):  # the commas of the rest, black re-lays them
            args = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in args]
        return with_keyword(call.with_changes(args=args), "positions", "positions")


def _construction(spec: RopeSpec) -> str:
    rope = spec.rope
    if spec.rope_dim is not None:
        rope = f'{{**{rope}, "rope_dim": {spec.rope_dim}}}'
    return (
        f"self.{spec.attr} = get_rope({spec.head}, max_position={MAX_POSITION}, "
        f"is_neox_style={spec.neox}, rope_parameters={rope})"
    )


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text).strip("\n") + "\n"


class _Replace(cst.CSTTransformer):
    def __init__(self, spec: RopeSpec):
        self.spec = spec

    def leave_Assign(self, original, updated: cst.Assign):
        value = updated.value
        if not (
            isinstance(value, cst.Call)
            and m.matches(value.func, m.Name())
            and value.func.value in self.spec.functions
        ):
            return updated
        q, k = (code(a.value) for a in value.args[:2])
        return updated.with_changes(
            value=cst.parse_expression(f"self._vllm_rope(positions, {q}, {k})")
        )


class _DropUnpack(cst.CSTTransformer):
    def __init__(self, spec: RopeSpec):
        self.spec = spec

    def leave_SimpleStatementLine(self, original, updated):
        if len(updated.body) == 1 and m.matches(
            updated.body[0],
            m.Assign(
                targets=[
                    m.AssignTarget(
                        m.Tuple(
                            [
                                m.Element(m.Name(self.spec.tables[0])),
                                m.Element(m.Name(self.spec.tables[1])),
                            ]
                        )
                    )
                ],
                value=m.Name(self.spec.param),
            ),
        ):
            return cst.RemoveFromParent()
        return updated


def _rewrite_forward(forward: cst.FunctionDef, spec: RopeSpec) -> cst.FunctionDef:
    forward = forward.visit(_Replace(spec))
    if spec.drop:
        forward = forward.visit(_DropUnpack(spec)).visit(DefaultNone({spec.param}))
    params = forward.params
    names = {p.name.value for p in [*params.params, *params.kwonly_params]}
    if "positions" not in names:
        param = cst.Param(
            cst.Name("positions"),
            annotation=cst.Annotation(cst.parse_expression("torch.Tensor | None")),
            default=cst.Name("None"),
        )
        if isinstance(params.star_arg, cst.Param) or params.kwonly_params:
            params = params.with_changes(kwonly_params=[*params.kwonly_params, param])
        else:
            params = params.with_changes(params=[*params.params, param])
    return forward.with_changes(params=params)


# --- the proof ------------------------------------------------------------------------


def _prove(model, n: str, param: str, tables, calls: list[cst.Call]) -> RopeSpec:
    info = model.classes[n]
    names = [c.func.value for c in calls]
    if len(set(names)) != len(names):
        raise PatternRefused(f"{names[0]} is called in more than one statement")
    for call in calls:
        _require_unread_after(info.forward, call)
    seen = {f: [] for f in names}  # f -> [(instance, args, out)]
    instances = model.probe.instances.get(n, [])
    for path, inst in instances:
        for f, runs in _run(model, inst, names).items():
            seen[f] += [(path, inst, a, out) for a, out in runs]
    ran = [f for f in names if seen[f]]
    if not ran:
        raise PatternRefused("the tiny model never runs its rotary function")
    head_value = {a[0].shape[-1] for f in ran for _, _, a, _ in seen[f]}
    if len(head_value) != 1:
        raise PatternRefused("the rotated head size differs between calls")
    _, inst0, a0, _ = seen[ran[0]][0]
    env0 = _env(inst0)
    heads = _int_attrs(info, inst0, head_value.pop())
    if not heads:
        raise PatternRefused(f"no attribute of {n} holds the rotated head size")
    axes = {f: _token_axis(seen[f]) for f in ran}
    for rope in ROPE_EXPRESSIONS:
        params = _eval(rope, env0)
        if not isinstance(params, dict) or "rope_theta" not in params:
            continue
        for head in heads:
            for rope_dim in [None, *_rope_dims(info, inst0, a0)]:
                for neox in (True, False):
                    spec = RopeSpec(
                        {f: axes[f] for f in ran},
                        tables,
                        param,
                        head,
                        rope,
                        rope_dim,
                        neox,
                        _free_attr(info),
                        [f for f in names if f not in ran],
                    )
                    if all(
                        _matches(spec, path, inst, a, out)
                        for f in ran
                        for path, inst, a, out in seen[f]
                    ):
                        _prove_theta_read(
                            model, spec, [r for f in ran for r in seen[f]]
                        )
                        spec.drop = _tables_unread(info.forward, spec)
                        return spec
    raise PatternRefused(
        "vLLM's rope computes something else (no head size, rotated dims, pair style "
        "and config rope parameters give the source's numbers)"
    )


def _tables_unread(forward: cst.FunctionDef, spec: RopeSpec) -> bool:
    """Once the calls are replaced and the unpacking dropped, nothing reads the tables
    (the parameter's own name is its one remaining occurrence)."""
    if spec.unrun:
        return False
    replaced = forward.visit(_Replace(spec))
    if any(len(m.findall(replaced, m.Name(t))) != 1 for t in spec.tables):
        return False
    dropped = replaced.visit(_DropUnpack(spec))
    return len(m.findall(dropped, m.Name(spec.param))) == 1


def _require_unread_after(forward: cst.FunctionDef, call: cst.Call) -> None:
    """vLLM's rope rotates q and k in place: the source must not read the tensors it
    handed its function after the call, except as the names the call rebinds."""
    import re

    text = code(forward)
    stmt = code(call)
    after = text[text.index(stmt) + len(stmt) :]
    for arg in call.args[:2]:
        name = code(arg.value)
        if not re.fullmatch(r"\w+", name):
            base = re.match(r"\w+", name)
            name = base.group(0) if base else name
        # the statement rebinds it, or nothing reads it again
        if re.search(rf"\b{re.escape(name)}\b", after) and not _rebinds(
            forward, call, name
        ):
            raise PatternRefused(f"`{name}` is read after the rotary call")


def _rebinds(forward: cst.FunctionDef, call: cst.Call, name: str) -> bool:
    for assign in m.findall(forward.body, m.Assign(value=m.Call())):
        if assign.value.deep_equals(call):
            return name in {code(e.value) for e in assign.targets[0].target.elements}
    return False


def _run(model, inst, names: list[str]) -> dict[str, list]:
    """What each function returns on this layer's own call (the attention itself
    stubbed: only the rotary function's numbers count)."""
    import sys

    import torch
    from transformers.modeling_utils import AttentionInterface

    call = model.call(inst)
    runs: dict[str, list] = {f: [] for f in names}
    if call is None:
        return runs
    args, kwargs, _ = call
    module = sys.modules[type(inst).__module__].__dict__
    originals = {f: module[f] for f in names}

    def recorder(f):
        def wrapped(*a, **kw):
            out = originals[f](*a, **kw)
            runs[f].append(
                (tuple(x.clone() if torch.is_tensor(x) else x for x in a), kw, out)
            )
            return out

        return wrapped

    def stub(mod, query, key, value, *rest, **kw):
        shape = (query.shape[0], query.shape[2], query.shape[1], value.shape[-1])
        return torch.zeros(shape, dtype=query.dtype), None

    AttentionInterface.register("codemods_rope", stub)
    config = getattr(inst, "config", None)
    saved = getattr(config, "_attn_implementation", None)
    try:
        module.update({f: recorder(f) for f in names})
        if saved is not None:
            config._attn_implementation = "codemods_rope"
        with torch.no_grad():
            inst(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    finally:
        module.update(originals)
        if saved is not None:
            config._attn_implementation = saved
    return {f: [(a, out) for a, _, out in r] for f, r in runs.items()}


def _env(inst) -> dict:
    """What the end of the class's `__init__` can read: its locals (the probe kept the
    numbers), its `config` parameter (the one the module keeps) and `self`."""
    local = getattr(inst, "_codemods_init_locals", None) or {}
    config = getattr(inst, "config", None)
    if config is None or "config" not in _init_params(type(inst)):
        raise PatternRefused(
            "its __init__ keeps no `config` its rope could be read from"
        )
    return {**local, "config": config, "self": inst}


def _init_params(cls) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(cls.__init__).parameters)
    except (TypeError, ValueError):
        return set()


def _eval(expr: str, env: dict):
    try:
        return eval(expr, {}, dict(env))  # noqa: S307 - expressions this module writes
    except Exception:
        return None


def _int_attrs(info, inst, value: int) -> list[str]:
    return [
        f"self.{a}"
        for a in info.attrs
        if type(getattr(inst, a, None)) is int and getattr(inst, a) == value
    ]


def _rope_dims(info, inst, args) -> list[str]:
    """Expressions of the rotated dims a table's width implies (the full width for
    tables of both halves, twice it for tables of one)."""
    width = args[2].shape[-1] if len(args) > 2 else None
    head = args[0].shape[-1]
    out = []
    for dims in dict.fromkeys((width, 2 * width) if width else ()):
        if dims <= head:
            out += _int_attrs(info, inst, dims)
    return list(dict.fromkeys(out))


def _free_attr(info) -> str:
    return next(
        a for a in ("rotary_emb", "vllm_rotary_emb", "vllm_rope") if a not in info.attrs
    )


def _token_axis(runs) -> int:
    axes = set()
    for _, _, a, _ in runs:
        q, k = a[0], a[1]
        tokens = a[2].shape[-2]
        found = {
            ax
            for ax in (1, 2)
            if q.dim() == 4
            and q.shape[0] == 1
            and q.shape[ax] == tokens
            and k.shape[ax] == tokens
        }
        if len(found) != 1:
            raise PatternRefused(
                f"cannot tell the token axis of a query shaped {tuple(q.shape)}"
            )
        axes |= found
    if len(axes) != 1:
        raise PatternRefused("the token axis differs between calls")
    return axes.pop()


def _vllm(spec: RopeSpec, env: dict, positions, q, k, axis: int):
    import torch
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params = _eval(spec.rope, env)
    if spec.rope_dim is not None:
        params = {**params, "rope_dim": _eval(spec.rope_dim, env)}
    rope = get_rope(
        _eval(spec.head, env),
        max_position=_eval(MAX_POSITION, env),
        is_neox_style=spec.neox,
        rope_parameters=params,
        dtype=torch.float32,
    )
    flat = [(t.transpose(1, 2) if axis == 2 else t) for t in (q, k)]
    tokens = positions.shape[0]
    out = rope.forward_native(positions, *(t.reshape(tokens, -1) for t in flat))
    return [o.view(f.shape) for o, f in zip(out, flat)]


def _matches(spec: RopeSpec, path, inst, args, out, env=None) -> bool:
    import torch

    from .dataflow import rel_err, REL_TOL

    env = env or _env(inst)
    if _eval(MAX_POSITION, env) is None:
        raise PatternRefused(
            "the config has no max_position_embeddings for vLLM's rope"
        )
    axis = spec.functions[next(iter(spec.functions))]
    q, k = args[0], args[1]
    tokens = q.shape[axis]
    try:
        got = _vllm(spec, env, torch.arange(tokens), q, k, axis)
    except Exception:
        return False
    want = [(t.transpose(1, 2) if axis == 2 else t) for t in out[:2]]
    return all(
        g.shape == w.shape and rel_err(g, w) <= REL_TOL for g, w in zip(got, want)
    )


def _rotary_module(model, runs):
    """(the module of the tiny model whose first call returned a layer's tables, that
    layer's run), for the first layer whose tables one did."""
    import torch

    calls = model.probe.module_calls
    for run in runs:
        table = run[2][2]
        for mod in model.probe.model.modules():
            out = calls.get(id(mod), (None, None, None))[2]
            if (
                isinstance(out, torch.Tensor)
                and out.shape == table.shape
                and torch.equal(out, table)
            ):
                return mod, run
    raise PatternRefused("no module of the tiny model computes its rotary tables")


def _prove_theta_read(model, spec: RopeSpec, runs) -> None:
    """The source's tables move with the config's rope theta as vLLM's do: its rotary
    module rebuilt from a config with every theta changed, the function on the new
    tables against vLLM's rope from the same config."""
    import torch

    rotary, (path, inst, args, out) = _rotary_module(model, runs)
    env = _env(inst)
    table = args[2]
    config = copy.deepcopy(getattr(rotary, "config", None) or env["config"])
    _scale_thetas(config.rope_parameters)
    try:
        rebuilt = type(rotary)(config=config)
    except Exception:
        raise PatternRefused(
            f"{type(rotary).__name__} cannot be rebuilt from a config with another rope theta"
        ) from None
    r_args, r_kwargs, _ = model.probe.module_calls[id(rotary)]
    with torch.no_grad():
        cos, sin = rebuilt(*r_args, **r_kwargs)
    if torch.equal(cos, table):
        raise PatternRefused(
            f"{type(rotary).__name__} does not read its theta from config.rope_parameters"
        )
    f = next(iter(spec.functions))
    import sys

    function = sys.modules[type(inst).__module__].__dict__[f]
    with torch.no_grad():
        new_out = function(args[0], args[1], cos, sin, *args[4:])
    env = {**env, "config": config}
    if not _matches(spec, path, inst, args, new_out, env):
        raise PatternRefused(
            "with another rope theta in the config, vLLM's rope and the source's differ"
        )


def _scale_thetas(params: dict) -> None:
    if "rope_theta" in params:
        params["rope_theta"] = params["rope_theta"] * 3.0
        return
    for i, sub in enumerate(v for v in params.values() if isinstance(v, dict)):
        if "rope_theta" in sub:
            sub["rope_theta"] = sub["rope_theta"] * (3.0 + i)
