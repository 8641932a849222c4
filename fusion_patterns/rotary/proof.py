"""The rope pattern's proof, on every layer of the tiny model that runs the source's
rotary function: what it returns there against the `get_rope` the generated file
builds, read from the same expressions the generated `__init__` evaluates; and once
more with every rope theta of the config changed and the source's rotary module
rebuilt from it (a source that does not read its rope from `config.rope_parameters`
must not pass for one that does)."""

from __future__ import annotations

import copy

import libcst as cst

from ..base import PatternRefused
from .emit import MAX_POSITION, tables_unread
from .match import RopeSpec, require_unread_after

# the rope parameters `get_rope` reads: the config's, or one per layer type (Gemma 3)
ROPE_EXPRESSIONS = (
    "config.rope_parameters",
    "config.rope_parameters[config.layer_types[layer_idx]]",
)


def prove(model, n: str, param: str, tables, calls: list[cst.Call]) -> RopeSpec:
    info = model.classes[n]
    names = [c.func.value for c in calls]
    if len(set(names)) != len(names):
        raise PatternRefused(f"{names[0]} is called in more than one statement")
    for call in calls:
        require_unread_after(info.forward, call)
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
                        spec.drop = tables_unread(info.forward, spec)
                        return spec
    raise PatternRefused(
        "vLLM's rope computes something else (no head size, rotated dims, pair style "
        "and config rope parameters give the source's numbers)"
    )


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

    from ..dataflow import REL_TOL, rel_err

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
