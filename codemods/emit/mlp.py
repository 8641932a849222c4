"""The MLP class: gate and up merged into one column-parallel GEMM, down row-parallel."""

from __future__ import annotations

import libcst as cst

from fusion_patterns.base import ClassInfo, code
from fusion_patterns.glu import GLUSpec

from .common import MLP_EXTRAS, indent, signature, translate_init


def emit(info: ClassInfo, spec: GLUSpec) -> str:
    def translate(attr: str, value: cst.BaseExpression) -> list[str] | None:
        if attr == spec.gate:
            in_size, _, bias = spec.gate_args
            sizes = f"[{code(spec.gate_args[1])}, {code(spec.up_args[1])}]"
            return [
                f"# Fused: {spec.gate} + {spec.up} -> {spec.merged} (shard 0 is the activated side)",
                f"self.{spec.merged} = MergedColumnParallelLinear({code(in_size)}, {sizes}, "
                f'bias={code(bias)}, quant_config=quant_config, prefix=f"{{prefix}}.{spec.merged}")',
            ]
        if attr == spec.up:
            return []
        if attr == spec.down:
            in_size, out_size, bias = spec.down_args
            return [
                f"self.{spec.down} = RowParallelLinear({code(in_size)}, {code(out_size)}, "
                f'bias={code(bias)}, quant_config=quant_config, prefix=f"{{prefix}}.{spec.down}")'
            ]
        if attr == spec.act_attr:
            return [f"self.{attr} = get_act_and_mul_fn({code(spec.act_name)})"]
        return None

    body = translate_init(info, translate)
    return f'''
class {info.name}(nn.Module):
    def __init__({signature(info, MLP_EXTRAS)}) -> None:
{indent(body)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        {spec.merged}, _ = self.{spec.merged}(x)
        x, _ = self.{spec.down}(self.{spec.act_attr}({spec.merged}))
        return x
'''
