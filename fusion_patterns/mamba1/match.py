"""The source's Mamba-1 mixer, read as the arguments of vLLM's `MambaMixer`.

A candidate is a class whose `__init__` builds a depthwise `nn.Conv1d`, an `x_proj` and
a `dt_proj` and the selective-scan parameters `A_log` and `D` (no `dt_bias`: that is
Mamba-2's), and whose forward takes `-torch.exp(self.A_log.float())`. Each argument is
the expression the source's own `__init__` assigns to the size it names
(`self.ssm_state_size = config.mamba_d_state` -> `ssm_state_size=config.mamba_d_state`);
norms on the time step, B and C (Jamba's, Falcon-Mamba's) are vLLM's `use_rms_norm`,
with or without weights as the source's norms hold them. The names are hypotheses: the
proof (`proof.py`) runs the source against vLLM's computation on the instance's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from ..base import ClassInfo, PatternRefused, Refusal, code, is_linear, linear_args
from ..moe.match import resolve as resolve_attrs
from ..state_layers import NEG_EXP_A_LOG, conv_attrs, read_or_refused

NAME = "mamba1"
VLLM_CLASS = "MambaMixer"
WHAT = "Mamba-1 mixer"

# MambaMixer argument -> the source attribute holding it (Mamba, Falcon-Mamba, Jamba)
SIZES = {
    "ssm_state_size": "ssm_state_size",
    "conv_kernel_size": "conv_kernel_size",
    "intermediate_size": "intermediate_size",
    "time_step_rank": "time_step_rank",
    "activation": "activation",
}
# the projections MambaMixer builds, by the names it loads them under
PROJECTIONS = ("in_proj", "x_proj", "dt_proj", "out_proj")
NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


@dataclass(frozen=True)
class Mamba1Spec:
    class_name: str
    conv: str
    # MambaMixer argument -> the source's expression (over `config` and the
    # constructor's own parameters)
    args: dict[str, cst.BaseExpression]
    # the source normalises the time step, B and C (vLLM's use_rms_norm)
    normed: bool = False
    # its norms hold a weight (Jamba) or none (Falcon-Mamba): the claim reads the
    # instance
    norm_weights: bool = True
    info: ClassInfo | None = field(default=None, compare=False, repr=False)


def is_candidate(info: ClassInfo) -> bool:
    if info.forward is None or info.init is None:
        return False
    convs = conv_attrs(info)
    return (
        bool(convs)
        and all(p in info.attrs for p in ("A_log", "D", "x_proj", "dt_proj"))
        and "dt_bias" not in info.attrs
    )


def match(info: ClassInfo) -> Mamba1Spec | Refusal | None:
    return read_or_refused(info, is_candidate, _read, NAME, WHAT)


def _read(info: ClassInfo) -> Mamba1Spec:
    if not m.findall(info.forward, NEG_EXP_A_LOG):
        raise PatternRefused("forward does not take A = -exp(self.A_log.float())")
    convs = conv_attrs(info)
    if len(convs) != 1:
        raise PatternRefused(f"{len(convs)} nn.Conv1d, expected one")
    if convs[0] != "conv1d":  # the name MambaMixer loads its conv weight under
        raise PatternRefused(f"its conv is self.{convs[0]}, not self.conv1d")
    for attr in PROJECTIONS:
        if not is_linear(info, attr):
            raise PatternRefused(f"self.{attr} is not an nn.Linear")
    missing = [a for a in SIZES.values() if a not in info.attrs]
    if missing:
        raise PatternRefused(
            f"__init__ sets no {', '.join('self.' + a for a in missing)}"
        )

    def resolve(expr: cst.BaseExpression) -> cst.BaseExpression:
        return resolve_attrs(expr, info, {})  # the constructor's own names stay

    args = {k: resolve(info.attrs[a]) for k, a in SIZES.items()}
    hidden, _, bias = linear_args(info.attrs["in_proj"])
    args["hidden_size"] = resolve(hidden)
    args["use_bias"] = resolve(bias)
    args["use_conv_bias"] = resolve(_keyword(info.attrs[convs[0]], "bias"))
    # vLLM's x_proj has no bias and its dt_proj one: the source's must agree
    for attr, want in (("x_proj", "False"), ("dt_proj", "True")):
        have = code(resolve(linear_args(info.attrs[attr])[2]))
        if have != want:
            raise PatternRefused(
                f"self.{attr} is built with bias={have}; vLLM's MambaMixer builds it "
                f"with bias={want}"
            )
    norms = [a for a in NORMS if a in info.attrs]
    if norms and len(norms) != len(NORMS):
        raise PatternRefused(
            f"it normalises only {', '.join(norms)}; vLLM's MambaMixer normalises the "
            "time step, B and C together or none"
        )
    if norms:
        eps = {code(resolve(_keyword(info.attrs[a], "eps"))) for a in NORMS}
        if len(eps) != 1:
            raise PatternRefused(
                f"its norms differ in eps ({', '.join(sorted(eps))}); vLLM's "
                "MambaMixer takes one"
            )
        args["rms_norm_eps"] = cst.parse_expression(eps.pop())
    return Mamba1Spec(
        class_name=info.name, conv=convs[0], args=args, normed=bool(norms), info=info
    )


def _keyword(value: cst.BaseExpression, name: str) -> cst.BaseExpression:
    if isinstance(value, cst.Call):
        for arg in value.args:
            if arg.keyword is not None and arg.keyword.value == name:
                return arg.value
    defaults = {"bias": "True"}
    if name in defaults:
        return cst.parse_expression(defaults[name])
    raise PatternRefused(f"`{code(value)}` is built without {name}=")
