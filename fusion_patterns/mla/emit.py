"""Latent attention: the source's sizes and scale, vLLM's MLA layer
(`MultiHeadLatentAttentionWrapper`, the latent KV cache) and the q/kv down-projections
merged into one replicated GEMM (`fused_qkv_a_proj`)."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ..base import ClassInfo, PatternRefused, code
from ..emitting import indent, signature, translate_init
from ..rms_norm import NormSpec
from .match import MERGED, MLASpec, linear_of

# vLLM 0.32's CPU rotary kernel mis-rotates a [tokens, heads, dim] query, the shape the
# MLA layer passes (found by the verification: logprobs off by ~1 from the second
# token); given [tokens, heads * dim] it is exact. Flattening is free on every platform.
FLAT_ROPE = '''
class _FlatRope(nn.Module):
    """Applies `rope` to [tokens, heads * dim] views of q and k, then restores their shapes."""

    def __init__(self, rope: nn.Module) -> None:
        super().__init__()
        self.rope = rope

    def forward(self, positions, q, k):
        q_out, k_out = self.rope(positions, q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1))
        return q_out.view(q.shape), k_out.view(k.shape)
'''

# LongCat multiplies the query and the normed latent by constants: folded into the q and
# kv norms' weights at load, as vLLM's own longcat_flash.py does (the MLA layer runs the
# norms itself, so there is no output to multiply)
SCALED_NORM = '''
def _load_scaled(norm: nn.Module, scale: float) -> None:
    """`norm`'s output is multiplied by the constant `scale`: its weight loads scaled."""
    base = getattr(norm.weight, "weight_loader", default_weight_loader)
    norm.weight.weight_loader = lambda param, loaded: base(param, loaded * scale)
'''


def _rope_types(info: ClassInfo, spec: MLASpec) -> list[str]:
    """The rope parameters vLLM's rope is built from: the source's, its rope type
    mapped where a scaled rope was proven (vLLM names DeepSeek's yarn its own way);
    a rope type no proof covered stops the model from loading, with its name."""
    proven = dict(spec.scaled_ropes)
    known = ", ".join(repr(t) for t in ["default", *proven])
    lines = [
        "rope_parameters = dict(config.rope_parameters)",
        'rope_type = rope_parameters.get("rope_type", "default")',
    ]
    renamed = {k: v for k, v in proven.items() if k != v}
    if renamed:
        lines += [
            "# the source's scaled rope as vLLM names the kernel proven to compute it",
            f"rope_parameters['rope_type'] = {renamed!r}.get(rope_type, rope_type)",
        ]
    return lines + [
        f"if rope_type not in ({known},):",
        "    raise ValueError(",
        f'        f"{info.name}: rope type {{rope_type!r}} for latent attention is not '
        f'generated yet (proven: {known})"',
        "    )",
    ]


def _split_heads(expr: cst.BaseExpression, what: str) -> list[cst.BaseExpression]:
    """`<heads> * (<a> + <b>)` -> [heads, a, b]; `<heads> * <a>` -> [heads, a]."""
    if not m.matches(expr, m.BinaryOperation(operator=m.Multiply())):
        raise PatternRefused(f"{what} `{code(expr)}` is not `<heads> * <size>`")
    right = expr.right
    if m.matches(right, m.BinaryOperation(operator=m.Add())):
        return [expr.left, right.left, right.right]
    return [expr.left, right]


def _norm(info: ClassInfo, attr: str, norms: dict[str, NormSpec]) -> str:
    for call in m.findall(info.attrs[attr], m.Call(func=m.Name())):
        if call.func.value in norms:
            return norms[call.func.value].construction(call)
    raise PatternRefused(f"self.{attr} is not a proven RMSNorm")


def _condition(info: ClassInfo, attr: str) -> str:
    """The test under which the source builds `attr` (`x if <test> else None`)."""
    value = info.attrs[attr]
    if isinstance(value, cst.IfExp):
        is_none = lambda n: m.matches(n, m.Name("None"))  # noqa: E731
        if is_none(value.orelse):
            return code(value.test)
        if is_none(value.body):
            return f"not ({code(value.test)})"
    return "True"


def _scaled(norm: str, scale: str | None) -> list[str]:
    if scale is None:
        return []
    return [
        f"# the source multiplies this norm's output by self.{scale}: its weight loads scaled",
        f"_load_scaled(self.{norm}, self.{scale})",
    ]


def emit(info: ClassInfo, spec: MLASpec, norms: dict[str, NormSpec]) -> str:
    modules = {
        spec.q_a,
        spec.q_norm,
        spec.q_b,
        spec.q_proj,
        spec.kv_a,
        spec.kv_norm,
        spec.kv_b,
        spec.o_proj,
    } - {None}
    # the source's plain attributes (sizes, scaling) are kept; its modules are rebuilt below
    body = translate_init(info, lambda attr, value: [] if attr in modules else None)
    if "scaling" not in info.attrs:
        raise PatternRefused(f"{info.name} sets no self.scaling")

    def linear(cls: str, attr: str, args, extra: str = "") -> str:
        size_in, size_out, bias = args
        return (
            f"self.{attr} = {cls}({code(size_in)}, {code(size_out)}, bias={code(bias)}{extra}, "
            f'quant_config=quant_config, prefix=f"{{prefix}}.{attr}")'
        )

    q_a, kv_a = linear_of(info, spec.q_a), linear_of(info, spec.kv_a)
    if code(q_a[2]) != code(kv_a[2]) or code(q_a[0]) != code(kv_a[0]):
        raise PatternRefused(
            f"{info.name}.{spec.q_a} and {spec.kv_a} differ in input or bias"
        )
    heads, nope, v = _split_heads(linear_of(info, spec.kv_b)[1], f"{spec.kv_b} output")
    cond = _condition(info, spec.q_a)
    q_lora = code(q_a[1])
    low_rank = [
        f"# Fused: {spec.q_a} + {spec.kv_a} -> {MERGED} (one replicated GEMM)",
        f"self.{MERGED} = MergedColumnParallelLinear({code(q_a[0])}, [{q_lora}, {code(kv_a[1])}], "
        f'bias={code(q_a[2])}, disable_tp=True, quant_config=quant_config, prefix=f"{{prefix}}.{MERGED}")',
        f"self.{spec.q_norm} = {_norm(info, spec.q_norm, norms)}",
        *_scaled(spec.q_norm, spec.q_scale),
        linear("ColumnParallelLinear", spec.q_b, linear_of(info, spec.q_b)),
        f"self.{spec.kv_a} = None",
    ]
    full_rank = [
        f"self.{MERGED} = self.{spec.q_norm} = self.{spec.q_b} = None",
        linear("ReplicatedLinear", spec.kv_a, kv_a),
    ]
    if spec.q_proj:
        low_rank.append(f"self.{spec.q_proj} = None")
        full_rank.append(
            linear("ColumnParallelLinear", spec.q_proj, linear_of(info, spec.q_proj))
        )
    elif cond != "True":
        raise PatternRefused(f"{info.name} has no q projection when not `{cond}`")
    if spec.q_scale and cond != "True":
        raise PatternRefused(
            f"{info.name} scales its query by self.{spec.q_scale}: without a q "
            f"low-rank (when not `{cond}`) there is no q norm to fold it into"
        )
    if cond == "True":  # the config always builds the q low-rank
        lines = list(low_rank)
    else:
        lines = [f"if {cond}:", *("    " + line for line in low_rank)]
        lines += ["else:", *("    " + line for line in full_rank)]
    lines += [
        f"self.{spec.kv_norm} = {_norm(info, spec.kv_norm, norms)}",
        *_scaled(spec.kv_norm, spec.kv_scale),
        linear("ColumnParallelLinear", spec.kv_b, linear_of(info, spec.kv_b)),
        linear("RowParallelLinear", spec.o_proj, linear_of(info, spec.o_proj)),
        *_rope_types(info, spec),
        "self.rotary_emb = _FlatRope(",
        f"    get_rope(self.{spec.rope_dim}, max_position=config.max_position_embeddings, "
        f"rope_parameters=rope_parameters, is_neox_style={code(spec.neox)})",
        ")",
        "self.mla_attn = MultiHeadLatentAttentionWrapper(",
        f"    {code(q_a[0])},",
        f"    {code(heads)} // get_tensor_model_parallel_world_size(),",
        "    self.scaling,",
        f"    {code(nope)},",
        f"    self.{spec.rope_dim},",
        f"    {code(v)},",
        f"    {q_lora}," if cond == "True" else f"    {q_lora} if {cond} else None,",
        f"    self.{spec.kv_lora_rank},",
        "    MLAModules(",
        f"        kv_a_layernorm=self.{spec.kv_norm},",
        f"        kv_b_proj=self.{spec.kv_b},",
        "        rotary_emb=self.rotary_emb,",
        f"        o_proj=self.{spec.o_proj},",
        f"        fused_qkv_a_proj=self.{MERGED},",
        f"        kv_a_proj_with_mqa=self.{spec.kv_a},",
        f"        q_a_layernorm=self.{spec.q_norm},",
        f"        q_b_proj=self.{spec.q_b},",
        f"        q_proj={f'self.{spec.q_proj}' if spec.q_proj else 'None'},",
        "        indexer=None,",
        "        is_sparse=False,",
        "        topk_indices_buffer=None,",
        "    ),",
        "    get_current_vllm_config().cache_config,",
        "    quant_config,",
        "    prefix,",
        ")",
    ]
    helpers = FLAT_ROPE + (SCALED_NORM if spec.q_scale or spec.kv_scale else "")
    return f"""{helpers}

class {info.name}(nn.Module):
    def __init__({signature(info)}) -> None:
{indent(body + lines)}

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # vLLM's layout: one row per token
        shape = hidden_states.shape
        out = self.mla_attn(positions, hidden_states.reshape(-1, shape[-1]))
        return out.view(*shape[:-1], -1)
"""
