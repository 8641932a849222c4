"""Gated DeltaNet (linear attention with the gated delta rule: Qwen3-Next's, Qwen3.5's)
-> vLLM's `QwenGatedDeltaNetAttention` (its conv and recurrent states in vLLM's state
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

from ..base import Claim, ClassInfo, FusionRecord, code
from ..moe.match import bind, resolve
from ..state_layers import (
    GATED_DELTA_NET,
    StateMixer,
    causal_hook,
    first_input,
)
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
    cpu_dtype = ("bfloat16", f"vLLM's CPU kernels for {VLLM_CLASS} run bf16 only")

    def read(self, info: ClassInfo):
        return match(info)

    def proven(self, spec: GatedDeltaNetSpec, instance, model, cls: str):
        prove(spec, instance, model.config)
        return spec

    def record(self, spec: GatedDeltaNetSpec, scope: str) -> FusionRecord:
        return FusionRecord(
            NAME,
            spec.class_name,
            (*spec.in_projs, "conv1d", "A_log + dt_bias", "norm", "out_proj"),
            scope.rsplit(".", 1)[-1] or "linear_attn",
            VLLM_CLASS,
            scope=scope,
            detail="conv and recurrent states in vLLM's state cache",
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
        return (
            f"{VLLM_CLASS}(gated_delta_net_config({fields}), "
            "get_current_vllm_config(), "
            # the state cache's key: the module's path
            f'prefix=f"{{prefix}}.{path or "linear_attn"}", '
            f"gqa_interleaved_layout={spec.interleaved})"
        )

    def call_site(self, claim: Claim, call: cst.Call) -> cst.BaseExpression:
        # vLLM's layer takes one row per token; the copied layers hold [1, tokens, hidden]
        x = code(first_input(claim.spec.info, call))
        return cst.parse_expression(
            f"{code(call.func)}({x}.flatten(0, -2)).view_as({x})"
        )

    def helpers(self, claim: Claim) -> tuple[str, ...]:
        return (CONFIG,)

    def causal_lm(self, claim: Claim, attends: bool):
        fields = claim.spec.fields
        shape = {k: code(fields[v]) for k, v in STATE_SHAPE.items()}
        return causal_hook(GATED_DELTA_NET, shape, attends)


# vLLM's layer reads its sizes from config fields a config class may name otherwise
CONFIG = '''
def gated_delta_net_config(**fields) -> SimpleNamespace:
    """The config fields vLLM's QwenGatedDeltaNetAttention reads, from the source's own
    expressions (a config class may name them otherwise)."""
    return SimpleNamespace(**fields)
'''
