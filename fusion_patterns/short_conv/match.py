"""The source's gated short convolution, read as the arguments of vLLM's `ShortConv`.

A candidate is a class whose `__init__` builds one `nn.Conv1d` over the sequence and no
parameters of its own, and whose forward splits an in-projection's output in three
(`B, C, x = BCx.chunk(3, ...)`): LFM2's `Lfm2ShortConv`. `ShortConv` computes
`out_proj(C * conv(B * x))` with a depthwise causal conv of `config.conv_L_cache` taps;
its arguments are read from the source's conv (`kernel_size`, `bias`, the channels) and
are only hypotheses: the proof (`proof.py`) runs the source against vLLM's computation
on the instance's weights over a prefill and decode steps, and refuses where one was
read wrong (B and C swapped, a kernel off by one, the gate dropped).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from ..base import ClassInfo, PatternRefused, Refusal, code, is_linear, linear_args
from ..moe.match import resolve as resolve_attrs
from ..state_layers import conv_attrs, parameter_attrs, read_or_refused

NAME = "short_conv"
VLLM_CLASS = "ShortConv"
WHAT = "gated short convolution"

_CHUNK3 = m.Call(
    func=m.Attribute(attr=m.Name("chunk")),
    args=[m.Arg(m.Integer("3")), m.ZeroOrMore()],
)


@dataclass(frozen=True)
class ShortConvSpec:
    class_name: str
    in_proj: str
    conv: str
    out_proj: str
    # ShortConv's `dim`, `config.conv_L_cache` and `config.conv_bias`, as the source's
    # expressions (over `config` and the constructor's own parameters)
    dim: cst.BaseExpression
    kernel: cst.BaseExpression
    bias: cst.BaseExpression
    info: ClassInfo | None = field(default=None, compare=False, repr=False)


def is_candidate(info: ClassInfo) -> bool:
    if info.forward is None or info.init is None:
        return False
    convs = conv_attrs(info)
    return (
        len(convs) == 1
        and not parameter_attrs(info)
        and bool(m.findall(info.forward, _CHUNK3))
    )


def match(info: ClassInfo) -> ShortConvSpec | Refusal | None:
    return read_or_refused(info, is_candidate, _read, NAME, WHAT)


def _read(info: ClassInfo) -> ShortConvSpec:
    conv = conv_attrs(info)[0]
    called = list(
        dict.fromkeys(
            c.func.attr.value
            for c in m.findall(
                info.forward, m.Call(func=m.Attribute(value=m.Name("self")))
            )
        )
    )
    linears = [a for a in called if is_linear(info, a)]
    if len(linears) != 2:
        raise PatternRefused(
            f"forward calls {len(linears)} linears, expected an in- and an "
            "out-projection"
        )

    def resolve(expr: cst.BaseExpression) -> cst.BaseExpression:
        return resolve_attrs(expr, info, {})  # the constructor's own names stay

    args = _conv_args(info.attrs[conv])
    dim, kernel = resolve(args["in_channels"]), resolve(args["kernel_size"])
    for what in ("out_channels", "groups"):
        if code(resolve(args.get(what, cst.Name("None")))) != code(dim):
            raise PatternRefused(
                f"self.{conv} is not depthwise over its {code(dim)} channels "
                f"({what}={code(args.get(what, cst.Name('None')))})"
            )
    biases = {a: code(resolve(linear_args(info.attrs[a])[2])) for a in linears}
    biases[conv] = code(resolve(args.get("bias", cst.Name("True"))))
    if len(set(biases.values())) != 1:
        raise PatternRefused(
            "its conv and projections do not share one bias setting ("
            + ", ".join(f"self.{a}: {b}" for a, b in biases.items())
            + "), which vLLM's ShortConv takes from one config.conv_bias"
        )
    return ShortConvSpec(
        class_name=info.name,
        in_proj=linears[0],
        conv=conv,
        out_proj=linears[1],
        dim=dim,
        kernel=kernel,
        bias=cst.parse_expression(biases[conv]),
        info=info,
    )


_CONV_PARAMS = ("in_channels", "out_channels", "kernel_size", "stride", "padding")


def _conv_args(call: cst.Call) -> dict[str, cst.BaseExpression]:
    positional = [a.value for a in call.args if a.keyword is None]
    out = dict(zip(_CONV_PARAMS, positional))
    out.update({a.keyword.value: a.value for a in call.args if a.keyword is not None})
    for need in ("in_channels", "kernel_size"):
        if need not in out:
            raise PatternRefused(f"its nn.Conv1d is built without {need}")
    return out
