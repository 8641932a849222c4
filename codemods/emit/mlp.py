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
    return f"""
class {info.name}(nn.Module):
    def __init__({signature(info, MLP_EXTRAS)}) -> None:
{indent(body)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        {spec.merged}, _ = self.{spec.merged}(x)
        x, _ = self.{spec.down}(self.{spec.act_attr}({spec.merged}))
        return x
"""


def emit_unfused(info: ClassInfo, columns: list[str], rows: list[str]) -> str:
    """The source MLP as it is, with its projections sharded: the ones reading the input
    column-parallel, the one producing the output row-parallel. Only elementwise ops
    run between them (checked on the traced module), so the shards compose."""
    from fusion_patterns.base import linear_args

    def translate(attr: str, value: cst.BaseExpression) -> list[str] | None:
        if attr in columns or attr in rows:
            in_size, out_size, bias = linear_args(value)
            cls = "ColumnParallelLinear" if attr in columns else "RowParallelLinear"
            return [
                f"self.{attr} = {cls}({code(in_size)}, {code(out_size)}, bias={code(bias)}, "
                f'quant_config=quant_config, prefix=f"{{prefix}}.{attr}")'
            ]
        return None

    body = translate_init(info, translate)
    forward = (
        code(info.forward.visit(_LinearOutputs(set(columns) | set(rows))))
        .strip("\n")
        .splitlines()
    )
    return f"""
class {info.name}(nn.Module):
    # Not fused (see the report): the source's own forward on sharded projections.
    def __init__({signature(info, MLP_EXTRAS)}) -> None:
{indent(body)}

{indent(forward, 1)}
"""


class _LinearOutputs(cst.CSTTransformer):
    """`self.<linear>(x)` -> `self.<linear>(x)[0]`: vLLM linears return (out, bias)."""

    def __init__(self, linears: set[str]):
        self.linears = linears

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        func = original.func
        if (
            isinstance(func, cst.Attribute)
            and isinstance(func.value, cst.Name)
            and func.value.value == "self"
            and func.attr.value in self.linears
        ):
            return cst.Subscript(
                value=updated, slice=[cst.SubscriptElement(cst.Index(cst.Integer("0")))]
            )
        return updated
