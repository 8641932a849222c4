"""The frame the stateful-mixer patterns share (Mamba-2, short convolutions, Mamba-1):
where copied modules call a mixer, and the causal LM's classmethods vLLM sizes, types
and copies the state cache with, one table row per mixer kind.

Each kind names vLLM's `MambaState*Calculator` methods for it and which arguments its
shape takes; the pattern gives the shape's values as the source's expressions over
`config`, the same expressions its layer is built with, so the cache and the layer
cannot disagree.
"""

from __future__ import annotations

import copy
import inspect
import os
import re
import traceback
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from .base import (
    CONSTRUCTION,
    CausalHook,
    Claim,
    ClassInfo,
    FusionRecord,
    Pattern,
    PatternRefused,
    Refusal,
    branch_keys,
    code,
    refused_by,
)

# `-torch.exp(self.A_log.float())`: the decay both Mamba mixers take
NEG_EXP_A_LOG = m.UnaryOperation(
    operator=m.Minus(),
    expression=m.Call(
        func=m.Attribute(value=m.Name("torch"), attr=m.Name("exp")),
        args=[
            m.Arg(
                m.Call(
                    func=m.Attribute(
                        value=m.Attribute(value=m.Name("self"), attr=m.Name("A_log")),
                        attr=m.Name("float"),
                    )
                )
            )
        ],
    ),
)


_CONV = ("nn.Conv1d", "torch.nn.Conv1d")
_PARAMETER = m.Call(
    func=m.Attribute(value=m.Name("nn"), attr=m.Name("Parameter")) | m.Name("Parameter")
)


def parameter_attrs(info: ClassInfo) -> set[str]:
    """The attributes `__init__` builds as an `nn.Parameter` (a mixer's own weights:
    `A_log`, `dt_bias`, `D`)."""
    return {a for a, v in info.attrs.items() if m.matches(v, _PARAMETER)}


def conv_attrs(info: ClassInfo) -> list[str]:
    """The attributes `__init__` builds as a `nn.Conv1d` (a mixer's conv over the
    sequence)."""
    return [a for a in info.attrs if info.constructed_class(a) in _CONV]


def read_or_refused(info: ClassInfo, candidate, read, name: str, what: str):
    """A mixer's match: None where `info` is no `candidate`, else `read(info)`'s spec,
    or a `Refusal` with why a candidate cannot be read."""
    if not candidate(info):
        return None
    try:
        return read(info)
    except PatternRefused as exc:
        return Refusal(name, info.name, what, str(exc))


class StateMixer(Pattern):
    """A mixer that keeps state across decode steps, claimed per construction: the
    class is not emitted, each construction is vLLM's layer keyed by its module path
    (its state-cache key), each call hands it one row per token. A subclass reads a
    class (`read`: a spec, a `Refusal` for a near miss, None), proves it on the tiny
    model's instance (`proven`) and records it (`record`)."""

    rewrites_calls = True
    keyed_by_prefix = True
    what = ""

    def read(self, info: ClassInfo):
        raise NotImplementedError

    def proven(self, spec, instance, model, cls: str):
        """The spec, proven on `instance` (raises PatternRefused where not)."""
        raise NotImplementedError

    def record(self, spec, scope: str) -> FusionRecord:
        raise NotImplementedError

    def maps_state(self, info: ClassInfo) -> bool:
        return self.read(info) is not None  # a near miss too: its refusal says why

    def claim(self, model):
        for n in model.roles.wanted:
            spec = self.read(model.classes[n])
            if spec is None:
                continue
            if isinstance(spec, Refusal):
                yield spec
                continue
            try:
                instance = model.first(n)
                if instance is None:
                    raise PatternRefused("the tiny model never builds it")
                if not call_sites(model, n):
                    raise PatternRefused("no copied module calls it")
                spec = self.proven(spec, instance, model, n)
            except Exception as exc:  # a proof that fails or cannot run: refused
                yield refused_by(exc, self.name, n, self.what)
                continue
            scopes = model.roles.scopes.get(n, [""])
            yield Claim(
                self,
                n,
                spec,
                CONSTRUCTION,
                records=[self.record(spec, scope) for scope in scopes],
            )


@dataclass(frozen=True)
class StateKind:
    """One mixer kind's state cache, as vLLM's `mamba_utils` calculators give it."""

    name: str  # the calculators' method prefix: `<name>_state_shape`
    # the dtype calculator takes the SSM state's dtype too (a conv state alone does not)
    ssm_dtype: bool
    # the shape calculator takes the number of speculative tokens
    num_spec: bool


MAMBA1 = StateKind("mamba1", ssm_dtype=True, num_spec=False)
MAMBA2 = StateKind("mamba2", ssm_dtype=True, num_spec=True)
SHORT_CONV = StateKind("short_conv", ssm_dtype=False, num_spec=True)
GATED_DELTA_NET = StateKind("gated_delta_net", ssm_dtype=True, num_spec=True)


def state_methods(kind: StateKind, shape: dict[str, str]) -> str:
    """The causal LM's classmethods: `shape` maps the shape calculator's keywords to
    expressions over `config` (the model's text config)."""
    dtypes = [
        "vllm_config.model_config.dtype",
        "vllm_config.cache_config.mamba_cache_dtype",
    ]
    if kind.ssm_dtype:
        dtypes.append("vllm_config.cache_config.mamba_ssm_cache_dtype")
    args = [f"{k}={v}" for k, v in shape.items()]
    args.append("tp_world_size=vllm_config.parallel_config.tensor_parallel_size")
    if kind.num_spec:
        args.append("num_spec=vllm_config.num_speculative_tokens")
    sep = ",\n            "
    return f"""
    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return MambaStateDtypeCalculator.{kind.name}_state_dtype(
            {sep.join(dtypes)},
        )

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        # the expressions the mixer is built with, on the same config
        config = vllm_config.model_config.hf_text_config
        return MambaStateShapeCalculator.{kind.name}_state_shape(
            {sep.join(args)},
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.{kind.name}_state_copy_func()
"""


def causal_hook(kind: StateKind, shape: dict[str, str], attends: bool) -> CausalHook:
    """Beside attention, vLLM aligns the state pages with the KV pages (IsHybrid);
    alone (Mamba), the model has no KV cache at all (IsAttentionFree)."""
    return CausalHook(
        ("HasInnerState", "IsHybrid" if attends else "IsAttentionFree"),
        state_methods(kind, shape),
        vllm_config="" if attends else "MambaModelConfig",
    )


_CONSTANTS = {"True": True, "False": False, "None": None}


def construction_constants(model, cls: str) -> dict:
    """The constant keyword arguments copied modules build `cls` with
    (`FalconMambaMixer(config, layer_idx=i, initialize_mixer_weights=False)` ->
    {"initialize_mixer_weights": False}): a rebuilt mixer is built the same way."""
    out = {}
    for owner in model.roles.wanted:
        init = model.classes[owner].init
        for call in m.findall(init, m.Call(func=m.Name(cls))) if init else ():
            for arg in call.args:
                value = arg.value
                if arg.keyword is not None and isinstance(value, cst.Name):
                    if value.value in _CONSTANTS:
                        out[arg.keyword.value] = _CONSTANTS[value.value]
    return out


def call_sites(model, cls: str) -> list[cst.Call]:
    """Every `self.<attr>(...)` of a copied module whose `<attr>` holds `cls` (for an
    attribute built from a class table, the calls in `cls`'s branch)."""
    calls = []
    for owner in model.roles.wanted:
        info = model.classes[owner]
        if info.forward is None:
            continue
        branches = branch_keys(info.forward)
        for attr in info.attrs:
            table = model.roles.tables.get((owner, attr))
            if table is None and cls not in info.constructed_classes(attr):
                continue
            calls += [
                call
                for call in m.findall(
                    info.forward,
                    m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(attr))),
                )
                if table is None or table.class_at(branches.get(id(call))) == cls
            ]
    return calls


def first_input(info, call: cst.Call) -> cst.BaseExpression:
    """The expression a call hands the mixer as its forward's first parameter."""
    params = [p.name.value for p in info.forward.params.params][1:]
    first = params[0] if params else "hidden_states"
    for i, arg in enumerate(call.args):
        if (arg.keyword is None and i == 0 and not arg.star) or (
            arg.keyword is not None and arg.keyword.value == first
        ):
            return arg.value
    raise PatternRefused(f"a call hands it no {first}")


# --- proving a mixer ------------------------------------------------------------------


def compared(source, vllm, prompt: int, steps: int, tolerance: float, names) -> None:
    """Runs both sides (`source()`, `vllm()`: [tokens, hidden]) and holds the prompt
    and each decode step after it to the source; `names` = (what runs over the prompt,
    what each step carries). A side that cannot run is not proven."""
    from .dataflow import require_close

    want, got = ran(source, vllm)
    for what, rows in step_parts(prompt, steps, names):
        require_close(got[rows], want[rows], what, tolerance)


def ran(*sides) -> list:
    """Each side's output; a side that cannot run: not proven (one line)."""
    try:
        return [side() for side in sides]
    except PatternRefused:
        raise
    except Exception as exc:  # noqa: BLE001 - a side that cannot run: not proven
        if os.environ.get("CODEMODS_DEBUG"):
            traceback.print_exc()
        what = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise PatternRefused(f"the comparison could not run: {what}") from exc


def step_parts(prompt: int, steps: int, names) -> list[tuple[str, slice]]:
    """(what, rows) of a mixer's output: the prompt, then each decode step; `names` =
    (what runs over the prompt, what each step carries)."""
    over, carried = names
    return [(f"{over} over the prompt", slice(0, prompt))] + [
        (f"decode step {i + 1} ({carried} carried)", slice(prompt + i, prompt + i + 1))
        for i in range(steps)
    ]


def evaluated(exprs: dict[str, cst.BaseExpression], config) -> dict:
    """A mixer's sizes (the source's expressions over `config`) on `config`."""
    try:
        return {
            k: eval(code(v), {"config": config}) for k, v in exprs.items()
        }  # noqa: S307
    except Exception as exc:  # noqa: BLE001 - an expression the config cannot give
        raise PatternRefused(f"its sizes do not evaluate on the config: {exc}") from exc


def require_shapes(expect: dict[str, tuple]) -> None:
    """{what: (the instance's shape, the one the read sizes give)}: equal, or refused."""
    for what, (have, want) in expect.items():
        if have != want:
            raise PatternRefused(
                f"{what} is {have}, the sizes it was read with give {want}"
            )


def proven_with_flags(prove_one, info, module, config, constants=None) -> None:
    """`prove_one(module, config)`, then again with each boolean config field the
    mixer's `__init__` reads flipped (the mixer rebuilt as its builders build it):
    vLLM's layer must follow the same fields."""
    prove_one(module, config)
    for flag in config_flags(info, config):
        other = flipped(config, flag)
        try:
            prove_one(rebuilt(module, other, constants), other)
        except PatternRefused as exc:
            raise PatternRefused(
                f"with config.{flag}={getattr(other, flag)}: {exc}"
            ) from exc


def config_flags(info, config) -> list[str]:
    """The boolean config fields the mixer's `__init__` reads."""
    names = re.findall(r"\bconfig\.(\w+)", code(info.init))
    return [
        n for n in dict.fromkeys(names) if isinstance(getattr(config, n, None), bool)
    ]


def flipped(config, *names: str):
    config = copy.deepcopy(config)
    for n in names:
        setattr(config, n, not getattr(config, n))
    return config


def rebuilt(module, config, constants: dict | None = None):
    """The mixer's class built anew on `config` (its other constructor parameters as
    the instance has them, or as `constants`, what its builders pass), with the buffers
    its owner registered on it."""
    params = inspect.signature(type(module).__init__).parameters
    kwargs = {}
    for name, p in list(params.items())[1:]:
        if name == "config":
            kwargs[name] = config
        elif name in (constants or {}):
            kwargs[name] = constants[name]
        elif hasattr(module, name):
            kwargs[name] = getattr(module, name)
        elif p.default is inspect.Parameter.empty:
            raise PatternRefused(f"cannot rebuild it without its {name}")
    fresh = type(module)(**kwargs)
    _weights_from(fresh, module)
    for name, buf in module.named_buffers(recurse=False):
        if name not in dict(fresh.named_buffers(recurse=False)):
            fresh.register_buffer(name, buf.clone(), persistent=False)
    return fresh


def _weights_from(fresh, module) -> None:
    """`fresh` takes `module`'s weights where a name and shape match (a mixer built to
    be loaded, `initialize_mixer_weights=False`, holds uninitialised memory); a weight
    only the other flag setting builds (a bias) is drawn small at random."""
    import torch

    own = module.state_dict()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, tensor in fresh.state_dict().items():
            if name in own and own[name].shape == tensor.shape:
                tensor.copy_(own[name])
            elif tensor.is_floating_point():
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.02)


# the source's cache parameter, under the names transformers' mixers give it
_CACHE_PARAMS = ("cache_params", "past_key_values", "past_key_value")


def source_outputs(module, config, x, prompt: int):
    """[tokens, hidden]: the source mixer over the prompt in one call, then one call per
    token, transformers' cache carrying its states (the source's own decode path)."""
    import torch
    from transformers import DynamicCache

    params = inspect.signature(module.forward).parameters
    name = next((p for p in _CACHE_PARAMS if p in params), None)
    if name is None:
        raise PatternRefused(
            "its forward takes no cache (none of "
            + ", ".join(_CACHE_PARAMS)
            + "): its decode path cannot be run"
        )
    cache = DynamicCache(config=config)
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int) and len(getattr(cache, "layers", ())) > idx + 1:
        # the module alone is the model's last layer: a cache asked whether "the last
        # linear-attention layer" holds a state (OLMo Hybrid's `has_previous_state()`)
        # asks about its layer, not a later one that never runs here
        cache.layers = cache.layers[: idx + 1]
    with torch.no_grad():
        outs = [module(x[:, :prompt], **{name: cache})]
        for t in range(prompt, x.shape[1]):
            outs.append(module(x[:, t : t + 1], **{name: cache}))
    # a decode step's output may come without its sequence axis (Falcon-H1's norm
    # squeezes it)
    return torch.cat([o.reshape(-1, o.shape[-1]) for o in outs], dim=0)


# vLLM's ShortConv and MambaMixer write one row per token into an output they are handed
CALL = '''
def state_layer(layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A vLLM layer with a state cache (ShortConv, MambaMixer) on the copied layers'
    [..., hidden] states: one row per token, written into an output it is handed."""
    rows = hidden_states.flatten(0, -2)
    output = torch.empty_like(rows)
    layer(rows, output)
    return output.view_as(hidden_states)
'''


def call_state_layer(call: cst.Call, info) -> cst.BaseExpression:
    """`self.<mixer>(x, cache, ...)` -> `state_layer(self.<mixer>, x)`."""
    x = code(first_input(info, call))
    return cst.parse_expression(f"state_layer({code(call.func)}, {x})")


# the checkpoint holds A_log; vLLM's mixers hold A, whose weight loader takes -exp(A_log)
NEGATED_A = """
    def {method}(self, weights: Iterable[tuple[str, torch.Tensor]]):
        # {layer}'s A is loaded from the checkpoint's A_log (its loader takes -exp)
        for name, tensor in weights:
            if name.endswith({ends}):
                name = name[: -len("A_log")] + "A"
            yield name, tensor
"""
