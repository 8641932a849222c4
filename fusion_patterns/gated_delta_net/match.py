"""The source's gated DeltaNet (linear attention with the gated delta rule), read as the
arguments of vLLM's `QwenGatedDeltaNetAttention`.

A candidate is a class whose `__init__` builds one `nn.Conv1d` over the sequence and
owns `A_log` and `dt_bias` parameters, and no `D` skip (Mamba-2's): Qwen3-Next's and
Qwen3.5's `...GatedDeltaNet`. vLLM's layer reads its sizes from config fields; the
source sets attributes of the same meaning (vLLM's layer was ported from it and keeps
their names), read here as the source's expressions over `config`.

Its in-projections come in one of the two layouts vLLM's layer loads: two (q|k|v|z and
b|a, interleaved by key-head group: Qwen3-Next's `in_proj_qkvz`, `in_proj_ba`) or four
(q|k|v, z, b, a: Qwen3.5's, stacked into vLLM's two merged projections). What is read
is a hypothesis: the proof (`proof.py`) runs the source against vLLM's computation.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import libcst as cst
import libcst.matchers as m

from ..base import ClassInfo, PatternRefused, Refusal, code, is_linear, self_attr
from ..moe.match import resolve
from ..state_layers import conv_attrs, parameter_attrs, read_or_refused

NAME = "gated_delta_net"
WHAT = "gated DeltaNet"


@dataclass(frozen=True)
class Target:
    """One of vLLM's gated-DeltaNet layers: the config fields it reads (each the
    source's attribute of the same meaning: vLLM's layers were ported from these
    sources and keep their names) and the names it loads the checkpoint by."""

    vllm_class: str
    # what the file builds: vLLM's class, or a subclass running vLLM's CPU ops where
    # vLLM's own class has Triton kernels only
    built: str
    fields: dict[str, str]
    children: tuple[str, ...]
    # ((the source's projections), vLLM's merged projection, shard ids); for Qwen's,
    # the flat layout's (its interleaved one loads as the checkpoint holds it)
    stacked: tuple[tuple[tuple[str, ...], str, tuple], ...]
    # it scales beta as a config field says (OLMo's negative eigenvalues); else a
    # source scaling its sigmoid gate is refused
    scales_beta: bool = False
    # its forward returns the output (else it writes into an output it is handed)
    returns: bool = True
    # the record's parts after the in-projections
    record: tuple[str, ...] = ("conv1d", "A_log + dt_bias", "norm", "out_proj")
    # the names its conv loads by as parts (q, k, v: published checkpoints hold three
    # convs, and vLLM's loader takes them one shard each), or None (one tensor)
    conv_parts: tuple[str, ...] | None = None
    # its in-projections are the stacked ones, by name (else read from the forward:
    # Qwen's two layouts)
    fixed_projections: bool = False


_SIZES = {
    "hidden_size": "hidden_size",
    "linear_num_key_heads": "num_k_heads",
    "linear_num_value_heads": "num_v_heads",
    "linear_key_head_dim": "head_k_dim",
    "linear_value_head_dim": "head_v_dim",
    "linear_conv_kernel_dim": "conv_kernel_size",
    "hidden_act": "activation",
}
QWEN = Target(
    "QwenGatedDeltaNetAttention",
    "QwenGatedDeltaNetAttention",
    {**_SIZES, "rms_norm_eps": "layer_norm_epsilon"},
    ("conv1d", "norm", "out_proj", "A_log", "dt_bias"),
    (
        (("in_proj_qkv", "in_proj_z"), "in_proj_qkvz", ((0, 1, 2), 3)),
        (("in_proj_b", "in_proj_a"), "in_proj_ba", (0, 1)),
    ),
)
OLMO = Target(
    "OlmoHybridGatedDeltaNetAttention",
    "OlmoHybridGatedDeltaNetOnCPU",
    {
        **_SIZES,
        "rms_norm_eps": "eps",
        "linear_allow_neg_eigval": "allow_neg_eigval",
    },
    ("conv1d", "o_norm", "o_proj", "A_log", "dt_bias", "a_proj", "b_proj"),
    ((("q_proj", "k_proj", "v_proj", "g_proj"), "in_proj_qkvg", (0, 1, 2, 3)),),
    scales_beta=True,
    returns=False,
    conv_parts=("q_conv1d", "k_conv1d", "v_conv1d"),
    record=("b_proj", "a_proj", "conv1d", "A_log + dt_bias", "o_norm", "o_proj"),
    fixed_projections=True,
)
TARGETS = (QWEN, OLMO)
VLLM_CLASS = QWEN.vllm_class
# Qwen's interleaved layout: two projections, loaded as the checkpoint holds them
INTERLEAVED = ("in_proj_qkvz", "in_proj_ba")


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    class_name: str
    target: Target
    # vLLM's config field -> the source's expression over `config` (and the
    # constructor's own parameters)
    fields: dict[str, cst.BaseExpression]
    # the in-projections in the order forward calls them (Qwen's: 2 interleaved or 4
    # flat; OLMo's: its four stacked ones)
    in_projs: tuple[str, ...]
    info: ClassInfo | None = field(default=None, compare=False, repr=False)

    @property
    def on_qwen(self) -> bool:
        """Onto vLLM's Qwen layer (its in-projection layout is read, not fixed)."""
        return self.target.vllm_class == QWEN.vllm_class

    @property
    def interleaved(self) -> bool:
        return self.in_projs == INTERLEAVED

    def stacked(self) -> list[tuple[tuple[str, ...], str, tuple]]:
        """(source parts, vLLM's merged projection, shard ids)."""
        return [] if self.interleaved else list(self.target.stacked)


def is_candidate(info: ClassInfo) -> bool:
    if info.forward is None or info.init is None:
        return False
    params = parameter_attrs(info)
    return (
        len(conv_attrs(info)) == 1
        and {"A_log", "dt_bias"} <= params
        and "D" not in params
    )


def match(info: ClassInfo) -> GatedDeltaNetSpec | Refusal | None:
    return read_or_refused(info, is_candidate, _read, NAME, WHAT)


def _scaled_gates(forward: cst.FunctionDef) -> list[str]:
    """`beta = beta * 2.0` after `beta = self.b_proj(x).sigmoid()` (OLMo Hybrid's
    `allow_neg_eigval`): a sigmoid gate scaled past [0, 1]."""
    gates = {
        a.targets[0].target.value
        for a in m.findall(forward, m.Assign(targets=[m.AssignTarget(m.Name())]))
        if m.findall(a.value, m.Call(func=m.Attribute(attr=m.Name("sigmoid"))))
    }
    return [
        code(a)
        for a in m.findall(forward, m.Assign(targets=[m.AssignTarget(m.Name())]))
        if a.targets[0].target.value in gates
        and m.matches(
            a.value,
            m.BinaryOperation(
                left=m.Name(a.targets[0].target.value), operator=m.Multiply()
            ),
        )
    ]


def _target(info: ClassInfo) -> Target:
    """The vLLM layer whose fields and names the class has (Qwen's, for the refusal,
    where none fits)."""
    for target in TARGETS:
        names = [*target.fields.values(), *target.children]
        if target.fixed_projections:
            names += [p for parts, _, _ in target.stacked for p in parts]
        if all(n in info.attrs for n in names):
            return target
    return QWEN


def _read(info: ClassInfo) -> GatedDeltaNetSpec:
    target = _target(info)
    scaled = _scaled_gates(info.forward)
    if scaled and not target.scales_beta:
        raise PatternRefused(
            f"it scales a sigmoid gate (`{scaled[0].strip()}`), which vLLM's "
            f"{target.vllm_class} does not (its CPU kernels take beta = sigmoid(b))"
        )
    missing = [f"self.{a}" for a in target.fields.values() if a not in info.attrs]
    if missing:
        raise PatternRefused(
            f"it sets no {', '.join(missing)}, the sizes vLLM's "
            f"{target.vllm_class} reads from its config"
        )
    fields = {k: resolve(info.attrs[a], info, {}) for k, a in target.fields.items()}
    absent = [c for c in target.children if c not in info.attrs]
    if absent:
        raise PatternRefused(
            f"it builds no {', '.join(absent)} under the names vLLM's "
            f"{target.vllm_class} loads them by"
        )
    if target.fixed_projections:
        parts = tuple(p for parts, _, _ in target.stacked for p in parts)
        return GatedDeltaNetSpec(info.name, target, fields, parts, info=info)
    called = [
        c.func.attr.value
        for c in m.findall(info.forward, m.Call(func=self_attr()))
        if is_linear(info, c.func.attr.value)
    ]
    in_projs = tuple(a for a in dict.fromkeys(called) if a != "out_proj")
    if len(in_projs) == 2 and in_projs != INTERLEAVED:
        raise PatternRefused(
            f"its two in-projections are {', '.join(in_projs)}; vLLM's "
            f"{target.vllm_class} loads the interleaved layout as "
            + ", ".join(INTERLEAVED)
        )
    if len(in_projs) not in (2, 4):
        raise PatternRefused(
            f"forward calls {len(in_projs)} in-projections, expected 2 (q|k|v|z, b|a) "
            "or 4 (q|k|v, z, b, a)"
        )
    if len(in_projs) == 4:  # stacked in the order forward calls them
        target = replace(
            target,
            stacked=tuple(
                (parts, merged, ids)
                for parts, (_, merged, ids) in zip(
                    (in_projs[:2], in_projs[2:]), target.stacked
                )
            ),
        )
    return GatedDeltaNetSpec(info.name, target, fields, in_projs, info=info)
