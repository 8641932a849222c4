"""The source's Mamba-2 mixer, read as the arguments of vLLM's `MambaMixer2`.

A candidate is a class whose `__init__` builds a depthwise `nn.Conv1d` over the
sequence and the selective-scan parameters (`A_log`, `dt_bias`, `D`) and whose
forward takes `-torch.exp(self.<A>.float())`. Each `MambaMixer2` argument is the
expression the source's own `__init__` assigns to the size it names (`self.n_groups =
config.mamba_n_groups` -> `n_groups=config.mamba_n_groups`); `hidden_size` is the
in-projection's input, `use_bias` its bias, `rms_norm_eps` the gated norm's eps. The
names are only hypotheses: the proof (`proof.py`) runs the source against vLLM's
computation on the instance's own weights and refuses where one was read wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from ..base import ClassInfo, PatternRefused, Refusal, code, is_linear, linear_args
from ..moe.match import resolve as resolve_attrs
from ..state_layers import NEG_EXP_A_LOG, conv_attrs, read_or_refused

NAME = "mamba2"
VLLM_CLASS = "MambaMixer2"
WHAT = "Mamba-2 mixer"

# MambaMixer2 argument -> the source attribute that holds it (every Mamba-2 mixer in
# transformers: Bamba, Falcon-H1, GraniteMoeHybrid, Mamba2, NemotronH, Zamba2)
SIZES = {
    "ssm_state_size": "ssm_state_size",
    "conv_kernel_size": "conv_kernel_size",
    "intermediate_size": "intermediate_size",
    "use_conv_bias": "use_conv_bias",
    "n_groups": "n_groups",
    "num_heads": "num_heads",
    "head_dim": "head_dim",
    "activation": "activation",
}
PARAMETERS = ("A_log", "dt_bias", "D")


@dataclass(frozen=True)
class Mamba2Spec:
    class_name: str
    in_proj: str
    conv: str
    norm: str
    out_proj: str
    # MambaMixer2 argument -> the source's expression (over `config` and the class's
    # own attributes, resolved to `config` where `__init__` assigns them from it)
    args: dict[str, cst.BaseExpression]
    chunk_size: cst.BaseExpression | None
    time_step_limit: cst.BaseExpression | None
    # the gated norm is built per group (from the mixer's n_groups); else it spans the
    # whole width, which vLLM's per-group norm equals only with one group
    norm_grouped: bool = False
    # the norm is built only where this holds (`Norm(...) if <cond> else nn.Identity()`;
    # the gate alone otherwise), MambaMixer2's `use_rms_norm`
    use_rms_norm: cst.BaseExpression | None = None
    # the in-projection's input scaled by `self.<in_scale>` (a config value) and its
    # output by `self.<out_scale>` (a vector): folded into its weight at load
    in_scale: cst.BaseExpression | None = None
    out_scale: str | None = None
    # how the output scale is computed, over `config` (the claim finds it: the mixer's
    # own `__init__` or its owner's `register_buffer`)
    out_scale_value: str | None = None
    # flag settings (tuples of (config field, value)) the proof found to differ
    unproven: tuple = ()
    # the source class: its constructor's parameters, bound at each construction
    info: ClassInfo | None = field(default=None, compare=False, repr=False)


def is_candidate(info: ClassInfo) -> bool:
    if info.forward is None or info.init is None:
        return False
    convs = conv_attrs(info)
    return bool(convs) and all(p in info.attrs for p in PARAMETERS)


def match(info: ClassInfo) -> Mamba2Spec | Refusal | None:
    return read_or_refused(info, is_candidate, _read, NAME, WHAT)


def _read(info: ClassInfo) -> Mamba2Spec:
    if not m.findall(info.forward, NEG_EXP_A_LOG):
        raise PatternRefused("forward does not take A = -exp(self.A_log.float())")
    convs = conv_attrs(info)
    if len(convs) != 1:
        raise PatternRefused(f"{len(convs)} nn.Conv1d, expected one")
    called = _self_calls(info.forward)
    linears = [a for a in called if is_linear(info, a)]
    if len(linears) < 2:
        raise PatternRefused("forward does not call an in- and an out-projection")
    in_proj, out_proj = linears[0], linears[-1]
    norms = [a for a in called if a not in (*linears, *convs)]
    gated = [a for a in norms if _called_with_two(info.forward, a)]
    if len(gated) != 1:
        raise PatternRefused("no gated norm `self.<norm>(y, gate)` in forward")
    missing = [a for a in SIZES.values() if a not in info.attrs]
    if missing:
        raise PatternRefused(
            f"__init__ sets no {', '.join('self.' + a for a in missing)}"
        )

    def resolve(expr: cst.BaseExpression) -> cst.BaseExpression:
        return resolve_attrs(expr, info, {})  # the constructor's own names stay

    args = {k: resolve(info.attrs[a]) for k, a in SIZES.items()}
    hidden, _, bias = linear_args(info.attrs[in_proj])
    args["hidden_size"] = resolve(hidden)
    args["use_bias"] = resolve(bias)
    eps = _keyword(info.attrs[gated[0]], "eps")
    if eps is None:
        raise PatternRefused(f"self.{gated[0]} is built without an eps")
    args["rms_norm_eps"] = resolve(eps)
    built, use_rms_norm = _optional(info.attrs[gated[0]])
    norm_grouped = code(args["n_groups"]) in code(resolve(built))
    in_scale, out_scale = _scales(info, in_proj)
    return Mamba2Spec(
        class_name=info.name,
        in_proj=in_proj,
        conv=convs[0],
        norm=gated[0],
        out_proj=out_proj,
        args=args,
        chunk_size=(
            resolve(info.attrs["chunk_size"]) if "chunk_size" in info.attrs else None
        ),
        time_step_limit=(
            resolve(info.attrs["time_step_limit"])
            if "time_step_limit" in info.attrs
            else None
        ),
        norm_grouped=norm_grouped,
        use_rms_norm=resolve(use_rms_norm) if use_rms_norm is not None else None,
        in_scale=resolve(in_scale) if in_scale is not None else None,
        out_scale=out_scale,
        info=info,
    )


_IDENTITY = m.Call(
    func=m.Attribute(value=m.Name("nn"), attr=m.Name("Identity")) | m.Name("Identity")
)


def _optional(value: cst.BaseExpression):
    """`Norm(...) if cond else nn.Identity()` -> (`Norm(...)`, cond); else (value, None)."""
    if isinstance(value, cst.IfExp) and m.matches(value.orelse, _IDENTITY):
        return value.body, value.test
    return value, None


def _scaled(stmt, name: str) -> str | None:
    """`<name> = <name> * self.<attr>` -> attr."""
    pattern = m.SimpleStatementLine(
        [
            m.Assign(
                targets=[m.AssignTarget(m.Name(name))],
                value=m.BinaryOperation(
                    left=m.Name(name),
                    operator=m.Multiply(),
                    right=m.Attribute(value=m.Name("self")),
                ),
            )
        ]
    )
    return stmt.body[0].value.right.attr.value if m.matches(stmt, pattern) else None


def _scales(info: ClassInfo, in_proj: str):
    """The scale on the in-projection's input (`x = x * self.s` before it, a value
    `__init__` sets) and on its output (`p = p * self.v` right after it)."""
    body = list(info.forward.body.body)
    call = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(in_proj)))
    at = next(
        (
            i
            for i, s in enumerate(body)
            if m.matches(
                s,
                m.SimpleStatementLine(
                    [m.Assign(targets=[m.AssignTarget(m.Name())], value=call)]
                ),
            )
        ),
        None,
    )
    if at is None:
        return None, None
    assign = body[at].body[0]
    out_name = assign.targets[0].target.value
    args = assign.value.args
    in_name = (
        args[0].value.value if args and isinstance(args[0].value, cst.Name) else None
    )
    in_scale = None
    for stmt in body[:at]:
        attr = _scaled(stmt, in_name) if in_name else None
        if attr is not None:
            if in_scale is not None or attr not in info.attrs:
                raise PatternRefused(
                    f"its in-projection's input is scaled by self.{attr}, "
                    "which is not one value __init__ sets"
                )
            in_scale = info.attrs[attr]
    out_scale = _scaled(body[at + 1], out_name) if at + 1 < len(body) else None
    return in_scale, out_scale


def _self_calls(node: cst.CSTNode) -> list[str]:
    calls = m.findall(node, m.Call(func=m.Attribute(value=m.Name("self"))))
    return list(dict.fromkeys(c.func.attr.value for c in calls))


def _called_with_two(forward: cst.FunctionDef, attr: str) -> bool:
    calls = m.findall(
        forward, m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(attr)))
    )
    return any(len(c.args) == 2 for c in calls)


def _keyword(value: cst.BaseExpression, name: str) -> cst.BaseExpression | None:
    for call in m.findall(value, m.Call()):
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == name:
                return arg.value
    return None
