"""Experts as transformers' stacked GLU: `gate_up` [E, 2I, H] chunked in two halves,
`act(gate) * up` with an `ACT2FN` activation vLLM's fused MoE has, one `down` [E, H, I];
no biases. vLLM's fused MoE layer holds them as they are (its loader splits the halves
per rank, and reads per-expert checkpoint tensors too)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import ClassInfo, PatternRefused
from ..moe.match import ExpertsSpec, match_experts, resolve
from ..moe.proof import evaluate, experts_reference


@dataclass(frozen=True)
class GLUExperts:
    spec: ExpertsSpec

    @property
    def sources(self) -> tuple[str, str]:
        return (self.spec.gate_up, self.spec.down)

    # the stacked names vLLM's loader renames the checkpoint's onto
    stacked = sources

    def factory_args(self, info: ClassInfo) -> dict[str, object]:
        s = self.spec
        return {
            "num_experts": resolve(s.num_experts, info, {}),
            "hidden_size": resolve(s.hidden, info, {}),
            "intermediate_size": resolve(s.intermediate, info, {}),
            "activation": resolve(s.act_name, info, {}),
        }

    def guards(self) -> list[str]:
        return []

    def loader(self):
        return None

    def prove(self, config, info: ClassInfo, module, check) -> "GLUExperts":
        """`config`: the one the experts are built with. `check(reference, hidden,
        experts)`: the module (its weights randomised here) against
        `reference` on random inputs and routings."""
        import torch

        from vllm.model_executor.layers.activation import get_act_and_mul_fn
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        s = self.spec
        act = str(evaluate(resolve(s.act_name, info, {}), config, "the activation key"))
        try:
            MoEActivation.from_str(act)
            act_and_mul = get_act_and_mul_fn(act).forward_native
        except ValueError:
            raise PatternRefused(
                f"vLLM's fused MoE has no activation {act!r}"
            ) from None
        extra = [
            n for n, _ in module.named_parameters() if n not in (s.gate_up, s.down)
        ]
        if extra:
            raise PatternRefused(
                f"they also hold {', '.join(extra)} (biases are not emitted yet)"
            )
        gate_up, down = getattr(module, s.gate_up), getattr(module, s.down)
        built = tuple(
            evaluate(resolve(e, info, {}), config, "an experts size")
            for e in (s.num_experts, s.intermediate, s.hidden)
        )
        if built != (gate_up.shape[0], down.shape[-1], gate_up.shape[-1]):
            raise PatternRefused(
                f"their sizes read from the config {built} are not the ones built "
                f"{(gate_up.shape[0], down.shape[-1], gate_up.shape[-1])}"
            )

        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in (gate_up, down):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)

        def reference(x, chosen, w):
            return experts_reference(x, chosen, w, gate_up, down, act_and_mul)

        check(reference, gate_up.shape[-1], gate_up.shape[0])
        return self


def match(info: ClassInfo, classes=None) -> GLUExperts | None:
    spec = match_experts(info)
    return None if spec is None else GLUExperts(spec)
