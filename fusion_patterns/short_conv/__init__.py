"""Gated short convolutions (LFM2's) -> vLLM's `ShortConv` (its conv state in vLLM's
state cache).

The match (`match.py`) reads the block's width, kernel and bias as `ShortConv`'s
arguments; the proof (`proof.py`) runs the source block against vLLM's computation over
a prefill and decode steps with the conv state carried. Claimed per construction: the
block's class is not emitted, each `Block(config, ...)` becomes `ShortConv(...)` (its
children named as the checkpoint names the source's: `conv`, `in_proj`, `out_proj`),
and each call hands it one row per token.
"""

from __future__ import annotations

import libcst as cst

from ..base import Claim, ClassInfo, FusionRecord, code
from ..moe.match import bind, resolve
from ..state_layers import CALL, SHORT_CONV, StateMixer, call_state_layer, causal_hook
from .match import NAME, VLLM_CLASS, WHAT, ShortConvSpec, match
from .proof import prove

__all__ = ["ShortConvPattern", "NAME", "VLLM_CLASS", "ShortConvSpec", "match", "prove"]


class ShortConvPattern(StateMixer):
    name = NAME
    what = WHAT

    def read(self, info: ClassInfo):
        return match(info)

    def proven(self, spec: ShortConvSpec, instance, model, cls: str) -> ShortConvSpec:
        prove(spec, instance, model.config)
        return spec

    def record(self, spec: ShortConvSpec, scope: str) -> FusionRecord:
        return FusionRecord(
            NAME,
            spec.class_name,
            (spec.in_proj, spec.conv, "C * conv(B * x)", spec.out_proj),
            scope.rsplit(".", 1)[-1] or "conv",
            VLLM_CLASS,
            scope=scope,
            detail="conv state in vLLM's state cache",
        )

    def construction(self, claim: Claim, call: cst.Call, path: str | None) -> str:
        spec = claim.spec
        bound = bind(spec.info, call)

        def arg(expr: cst.BaseExpression) -> str:
            return code(resolve(expr, spec.info, bound))

        return (
            f"ShortConv(short_conv_config(conv_L_cache={arg(spec.kernel)}, "
            f"conv_bias={arg(spec.bias)}), dim={arg(spec.dim)}, "
            "layer_idx=extract_layer_index(prefix), "
            "model_config=get_current_vllm_config().model_config, "
            "cache_config=get_current_vllm_config().cache_config, "
            "quant_config=quant_config, "
            # the state cache's key: the module's path
            f'prefix=f"{{prefix}}.{path or "conv"}")'
        )

    def call_site(self, claim: Claim, call: cst.Call) -> cst.BaseExpression:
        return call_state_layer(call, claim.spec.info)

    def helpers(self, claim: Claim) -> tuple[str, ...]:
        return (CONFIG, CALL)

    def causal_lm(self, claim: Claim, attends: bool):
        spec = claim.spec
        shape = {"intermediate_size": code(spec.dim), "conv_kernel": code(spec.kernel)}
        return causal_hook(SHORT_CONV, shape, attends)


# vLLM's ShortConv reads its kernel and bias from two config fields
CONFIG = '''
def short_conv_config(conv_L_cache: int, conv_bias: bool) -> SimpleNamespace:
    """The two fields vLLM's ShortConv reads from its config, from the source's own
    expressions (a config class may name them otherwise)."""
    return SimpleNamespace(conv_L_cache=conv_L_cache, conv_bias=conv_bias)
'''
