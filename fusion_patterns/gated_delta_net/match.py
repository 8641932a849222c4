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

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from ..base import ClassInfo, PatternRefused, Refusal, code, is_linear, self_attr
from ..moe.match import resolve
from ..state_layers import conv_attrs, read_or_refused

NAME = "gated_delta_net"
VLLM_CLASS = "QwenGatedDeltaNetAttention"
WHAT = "gated DeltaNet"

# vLLM's layer reads config field -> the source's attribute of the same meaning
FIELDS = {
    "hidden_size": "hidden_size",
    "linear_num_key_heads": "num_k_heads",
    "linear_num_value_heads": "num_v_heads",
    "linear_key_head_dim": "head_k_dim",
    "linear_value_head_dim": "head_v_dim",
    "linear_conv_kernel_dim": "conv_kernel_size",
    "hidden_act": "activation",
    "rms_norm_eps": "layer_norm_epsilon",
}
# vLLM's layer's children and parameters: the checkpoint's names must be these
CHILDREN = ("conv1d", "norm", "out_proj", "A_log", "dt_bias")
# vLLM's merged in-projections: (name, the shard ids of the source's flat parts)
MERGED = (("in_proj_qkvz", ((0, 1, 2), 3)), ("in_proj_ba", (0, 1)))

_PARAMETER = m.Call(
    func=m.Attribute(value=m.Name("nn"), attr=m.Name("Parameter")) | m.Name("Parameter")
)


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    class_name: str
    # vLLM's config field -> the source's expression over `config` (and the
    # constructor's own parameters)
    fields: dict[str, cst.BaseExpression]
    # the in-projections in the order forward calls them: 2 (interleaved) or 4 (flat)
    in_projs: tuple[str, ...]
    info: ClassInfo | None = field(default=None, compare=False, repr=False)

    @property
    def interleaved(self) -> bool:
        return len(self.in_projs) == 2

    def stacked(self) -> list[tuple[tuple[str, ...], str, tuple]]:
        """(source parts, vLLM's merged projection, shard ids) for the flat layout."""
        if self.interleaved:
            return []
        parts = (self.in_projs[:2], self.in_projs[2:])
        return [(p, name, ids) for p, (name, ids) in zip(parts, MERGED)]


def _params(info: ClassInfo) -> set[str]:
    return {a for a, v in info.attrs.items() if m.matches(v, _PARAMETER)}


def is_candidate(info: ClassInfo) -> bool:
    if info.forward is None or info.init is None:
        return False
    params = _params(info)
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


def _read(info: ClassInfo) -> GatedDeltaNetSpec:
    scaled = _scaled_gates(info.forward)
    if scaled:
        raise PatternRefused(
            f"it scales a sigmoid gate (`{scaled[0].strip()}`), which vLLM's "
            f"{VLLM_CLASS} does not (its CPU kernels take beta = sigmoid(b))"
        )
    missing = [f"self.{a}" for a in FIELDS.values() if a not in info.attrs]
    if missing:
        raise PatternRefused(
            f"it sets no {', '.join(missing)}, the sizes vLLM's "
            f"{VLLM_CLASS} reads from its config"
        )
    fields = {k: resolve(info.attrs[a], info, {}) for k, a in FIELDS.items()}
    absent = [c for c in CHILDREN if c not in info.attrs]
    if absent:
        raise PatternRefused(
            f"it builds no {', '.join(absent)} under the names vLLM's {VLLM_CLASS} "
            "loads them by"
        )
    called = [
        c.func.attr.value
        for c in m.findall(info.forward, m.Call(func=self_attr()))
        if is_linear(info, c.func.attr.value)
    ]
    in_projs = tuple(a for a in dict.fromkeys(called) if a != "out_proj")
    if len(in_projs) == 2 and in_projs != tuple(name for name, _ in MERGED):
        raise PatternRefused(
            f"its two in-projections are {', '.join(in_projs)}; vLLM's "
            f"{VLLM_CLASS} loads the interleaved layout as "
            + ", ".join(name for name, _ in MERGED)
        )
    if len(in_projs) not in (2, 4):
        raise PatternRefused(
            f"forward calls {len(in_projs)} in-projections, expected 2 (q|k|v|z, b|a) "
            "or 4 (q|k|v, z, b, a)"
        )
    return GatedDeltaNetSpec(info.name, fields, in_projs, info=info)
