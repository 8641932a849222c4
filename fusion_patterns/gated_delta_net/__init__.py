"""Gated DeltaNet (linear attention with the gated delta rule: Qwen3-Next's, Qwen3.5's,
OLMo Hybrid's) -> vLLM's `QwenGatedDeltaNetAttention` or
`OlmoHybridGatedDeltaNetAttention` (their conv and recurrent states in vLLM's state
cache).

The match (`match.py`) reads the layer's sizes as the config fields vLLM's layer reads
and its in-projections' layout; the proof (`proof.py`) runs the source against vLLM's
computation over a prefill and decode steps with both states carried. Claimed per
construction: the class is not emitted, each `GatedDeltaNet(config, ...)` becomes
vLLM's layer over a config holding the source's expressions, each call hands it one row
per token. vLLM's CPU kernels for it run bfloat16 only: the file says so in its header
and `verify` runs it so.
"""

from __future__ import annotations

import libcst as cst

from ..base import Claim, ClassInfo, FusionRecord, LoaderHook, code
from ..moe.match import bind, resolve
from ..state_layers import (
    CALL,
    GATED_DELTA_NET,
    StateMixer,
    call_state_layer,
    causal_hook,
    first_input,
)
from .emit import CONFIG, CONV_PARTS, OLMO_ON_CPU, RULE_ON_CPU
from .match import NAME, VLLM_CLASS, WHAT, GatedDeltaNetSpec, match
from .proof import prove

__all__ = ["GatedDeltaNet", "NAME", "VLLM_CLASS", "GatedDeltaNetSpec", "match", "prove"]

# the state cache's shape calculator's keywords -> vLLM's config fields
STATE_SHAPE = {
    "num_k_heads": "linear_num_key_heads",
    "num_v_heads": "linear_num_value_heads",
    "head_k_dim": "linear_key_head_dim",
    "head_v_dim": "linear_value_head_dim",
    "conv_kernel_size": "linear_conv_kernel_dim",
}


class GatedDeltaNet(StateMixer):
    name = NAME
    what = WHAT
    cpu_dtype = ("bfloat16", "vLLM's CPU gated-delta-rule kernels run bf16 only")

    def read(self, info: ClassInfo):
        return match(info)

    def proven(self, spec: GatedDeltaNetSpec, instance, model, cls: str):
        prove(spec, instance, model.config)
        return spec

    def record(self, spec: GatedDeltaNetSpec, scope: str) -> FusionRecord:
        target = spec.target
        on_cpu = (
            ""
            if target.built == target.vllm_class
            else "; on vLLM's CPU build, whose kernels for it are Triton only, its "
            "core on vLLM's CPU gated-delta-rule ops"
        )
        return FusionRecord(
            NAME,
            spec.class_name,
            (*spec.in_projs, *target.record),
            scope.rsplit(".", 1)[-1] or "linear_attn",
            target.vllm_class,
            scope=scope,
            detail="conv and recurrent states in vLLM's state cache" + on_cpu,
        )

    def claim(self, model):
        for out in super().claim(model):
            if isinstance(out, Claim):
                # the flat layout's projections, stacked into vLLM's two merged ones
                out.records += [
                    FusionRecord(
                        NAME,
                        out.spec.class_name,
                        parts,
                        merged,
                        "MergedColumnParallelLinear",
                        shard_ids=ids,
                        scope=r.scope,
                    )
                    for r in list(out.records)
                    for parts, merged, ids in out.spec.stacked()
                ]
            yield out

    def construction(self, claim: Claim, call: cst.Call, path: str | None) -> str:
        spec = claim.spec
        bound = bind(spec.info, call)
        fields = ", ".join(
            f"{k}={code(resolve(v, spec.info, bound))}" for k, v in spec.fields.items()
        )
        layout = f", gqa_interleaved_layout={spec.interleaved}" if spec.on_qwen else ""
        return (
            f"{spec.target.built}(gated_delta_net_config({fields}), "
            "get_current_vllm_config(), "
            # the state cache's key: the module's path
            f'prefix=f"{{prefix}}.{path or "linear_attn"}"{layout})'
        )

    def call_site(self, claim: Claim, call: cst.Call) -> cst.BaseExpression:
        # vLLM's layer takes one row per token; the copied layers hold [1, tokens, hidden]
        if not claim.spec.target.returns:
            return call_state_layer(call, claim.spec.info)
        x = code(first_input(claim.spec.info, call))
        return cst.parse_expression(
            f"{code(call.func)}({x}.flatten(0, -2)).view_as({x})"
        )

    def loader(self, claim: Claim) -> LoaderHook | None:
        parts = claim.spec.target.conv_parts
        if not parts:
            return None
        scopes = sorted({r.scope for r in claim.records})
        ends = tuple(f".{s}.{c}.weight" for s in scopes for c in ("conv1d", *parts))
        return LoaderHook(
            CONV_PARTS.format(ends=ends, parts=parts),
            weights="self._conv_parts({weights}, loaded)",
            reports_loaded=True,
        )

    def helpers(self, claim: Claim) -> tuple[str, ...]:
        target = claim.spec.target
        return (
            (CONFIG,)
            + (() if target.returns else (CALL,))
            + (() if target.built == target.vllm_class else (RULE_ON_CPU, OLMO_ON_CPU))
        )

    def causal_lm(self, claim: Claim, attends: bool):
        fields = claim.spec.fields
        shape = {k: code(fields[v]) for k, v in STATE_SHAPE.items()}
        return causal_hook(GATED_DELTA_NET, shape, attends)
