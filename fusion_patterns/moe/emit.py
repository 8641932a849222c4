"""The MoE block: router and experts -> one vLLM fused MoE layer (`FusedMoEFactory`).

The router's weight becomes a `GateLinear` (replicated, it is small); the experts become
the fused layer, sharded over tensor-parallel ranks by their intermediate size, or over
expert-parallel ranks when the engine runs with `enable_expert_parallel=True`. Its
weight loader reads both checkpoint layouts: per-expert tensors
(`experts.<e>.gate_proj.weight`) and the stacked ones transformers v5 keeps in memory
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

import libcst as cst

from ..base import ClassInfo, code
from ..emitting import EXTRAS, indent, signature, translate_init, with_extras
from .match import MoESpec


def emit(info: ClassInfo, spec: MoESpec) -> str:
    done: set[str] = set()

    def gate_lines() -> list[str]:
        # built before the experts: the fused layer reads its correction bias
        done.add(spec.router_attr)
        lines = [
            f"self.{spec.router_attr} = GateLinear({code(spec.hidden)}, {code(spec.num_experts)}, "
            f'bias=False, quant_config=quant_config, prefix=f"{{prefix}}.{spec.router_attr}")'
        ]
        if spec.router.bias:
            lines.append(
                f"self.{spec.router_attr}.{spec.router.bias} = nn.Parameter("
                f"torch.empty({code(spec.num_experts)}, dtype=torch.float32))"
            )
        return lines

    def translate(attr: str, value: cst.BaseExpression) -> list[str] | None:
        if attr == spec.router_attr:
            return [] if attr in done else gate_lines()
        if attr == spec.experts_attr:
            routing = [f"    {k}={v}," for k, v in spec.routing]
            return [
                *([] if spec.router_attr in done else gate_lines()),
                f"# Fused: {spec.router_attr} + {attr} -> FusedMoE ({spec.describe_routing()})",
                f"self.{attr} = FusedMoEFactory(",
                f"    num_experts={code(spec.num_experts)},",
                f"    top_k={code(spec.top_k)},",
                f"    hidden_size={code(spec.hidden)},",
                f"    intermediate_size={code(spec.intermediate)},",
                f"    renormalize={code(spec.renormalize)},",
                f"    activation={code(spec.activation)},",
                *routing,
                "    quant_config=quant_config,",
                f'    prefix=f"{{prefix}}.{attr}",',
                ")",
            ]
        if attr == spec.shared_attr:
            return [f"self.{attr} = {with_extras(value, EXTRAS, attr)}"]
        return None

    body = translate_init(info, translate)
    shared = (
        f"\n        out = out + self.{spec.shared_attr}(hidden_states)"
        if spec.shared_attr
        else ""
    )
    return f"""
class {info.name}(nn.Module):
    def __init__({signature(info)}) -> None:
{indent(body)}

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden_states = hidden_states.view(-1, shape[-1])
        router_logits, _ = self.{spec.router_attr}(hidden_states)
        out = self.{spec.experts_attr}(hidden_states, router_logits){shared}
        return out.view(shape)
"""
