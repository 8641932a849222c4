"""The attention class: q/k/v merged into `QKVParallelLinear`, paged `Attention`, rope."""

from __future__ import annotations

import libcst as cst

from fusion_patterns.base import ClassInfo, code
from fusion_patterns.qkv import QKVSpec
from fusion_patterns.rms_norm import NormSpec, is_norm_call

from ..errors import CodemodError
from .common import (
    ATTENTION_EXTRAS,
    indent,
    norm_construction,
    signature,
    translate_init,
)

# Keyword arguments of the transformers attention call -> vLLM `Attention` arguments.
CALL_KWARGS = {
    "scaling": "scale",
    "sliding_window": "per_layer_sliding_window",
    "softcap": "logits_soft_cap",
}
# A norm over the whole q or k projection (OLMo 2): each rank holds some heads, so the
# projection is gathered, normed whole and split again, as vLLM's olmo2.py does.
WHOLE_PROJECTION_NORM = """
    def _whole_projection_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return norm(x)
        x = norm(tensor_model_parallel_all_gather(x.contiguous()))
        return split_tensor_along_last_dim(x, self.tp_size)[self.tp_rank].contiguous()
"""
# Training-only arguments with no effect at inference.
IGNORED_KWARGS = {"dropout"}


def _qkv_block(spec: QKVSpec) -> list[str]:
    hd = f"self.{spec.head_dim_attr}"
    q, k, v = spec.projections
    fused = (
        f"# {spec.merged}: packed [q; k; v] in the checkpoint, split by the weight loader."
        if spec.packed
        else f"# Fused: {q} + {k} + {v} -> {spec.merged}."
    )
    return [
        f"{fused} Each rank holds its own heads of q, k",
        "# and v; with fewer kv heads than ranks, k and v are replicated.",
        "tp_size = get_tensor_model_parallel_world_size()",
        f"self.total_num_heads = {code(spec.num_heads)}",
        f"self.total_num_kv_heads = {code(spec.num_kv_heads)}",
        "assert self.total_num_heads % tp_size == 0",
        "if self.total_num_kv_heads >= tp_size:",
        "    assert self.total_num_kv_heads % tp_size == 0",
        "else:",
        "    assert tp_size % self.total_num_kv_heads == 0",
        "self.num_heads = self.total_num_heads // tp_size",
        "self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)",
        f"self.q_size = self.num_heads * {hd}",
        f"self.kv_size = self.num_kv_heads * {hd}",
        f"self.{spec.merged} = QKVParallelLinear({code(spec.hidden_size)}, {hd}, self.total_num_heads, "
        f'self.total_num_kv_heads, bias={code(spec.bias)}, quant_config=quant_config, prefix=f"{{prefix}}.{spec.merged}")',
    ]


def _window_lines(spec: QKVSpec) -> list[str]:
    """The window this layer slides over, exactly as the source passes it to its attention
    call (None when it passes none). vLLM's `Attention` falls back to the model-level window
    (`cache_config.sliding_window`) when given None, which would slide a layer the source
    does not; so where the source says None, that fallback is switched off."""
    window = spec.call_kwargs.get("sliding_window")
    return [
        f"sliding_window = {code(window) if window is not None else 'None'}",
        "if sliding_window is None and cache_config is not None and cache_config.sliding_window:",
        "    # the source attends fully here: keep vLLM from applying the model-level window",
        "    cache_config = copy(cache_config)",
        "    cache_config.sliding_window = None",
    ]


def _attention_args(spec: QKVSpec) -> list[str]:
    args = ["self.num_heads", f"self.{spec.head_dim_attr}"]
    kwargs = {}
    for name, value in spec.call_kwargs.items():
        if name in IGNORED_KWARGS:
            continue
        if name not in CALL_KWARGS:
            raise CodemodError(
                f"cannot generate: {spec.class_name} passes `{name}=` to its attention call, not emitted yet"
            )
        kwargs[CALL_KWARGS[name]] = code(value)
    if "scale" not in kwargs:
        raise CodemodError(
            f"cannot generate: {spec.class_name} passes no `scaling=` to its attention call"
        )
    args.append(kwargs.pop("scale"))
    args += [
        "num_kv_heads=self.num_kv_heads",
        "cache_config=cache_config",
        "quant_config=quant_config",
    ]
    kwargs.pop("per_layer_sliding_window", None)  # passed explicitly, see _window_lines
    args += [f"{k}={v}" for k, v in kwargs.items()]
    args += ["per_layer_sliding_window=sliding_window", 'prefix=f"{prefix}.attn"']
    return args


def emit(
    info: ClassInfo,
    spec: QKVSpec,
    norms: dict[str, NormSpec],
    neox: bool,
    rope_by_layer_type: bool,
) -> str:
    q, k, v = spec.projections

    def translate(attr: str, value: cst.BaseExpression) -> list[str] | None:
        if attr == q:
            return _qkv_block(spec)
        if attr in (k, v):
            return []
        if attr == spec.out_proj:
            in_size, out_size, bias = spec.out_args
            return [
                f"self.{attr} = RowParallelLinear({code(in_size)}, {code(out_size)}, bias={code(bias)}, "
                f'quant_config=quant_config, prefix=f"{{prefix}}.{attr}")'
            ]
        if norm := is_norm_call(value, norms):
            return [f"self.{attr} = {norm_construction(norm, value)}"]
        return None

    body = translate_init(info, translate)
    hd = f"self.{spec.head_dim_attr}"
    rope = "config.rope_parameters"
    if rope_by_layer_type:
        params = [p.name.value for p in info.init.params.params]
        if "layer_idx" not in params:
            raise CodemodError(
                f"cannot generate: rope differs by layer type but {info.name}.__init__ takes no layer_idx"
            )
        rope = "config.rope_parameters[config.layer_types[layer_idx]]"
    body += [
        f"self.rotary_emb = get_rope({hd}, max_position=config.max_position_embeddings, "
        f"is_neox_style={neox}, rope_parameters={rope})",
        *_window_lines(spec),
        f"self.attn = Attention({', '.join(_attention_args(spec))})",
    ]

    fwd = [
        f"qkv, _ = self.{spec.merged}(hidden_states)",
        "q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)",
    ]
    if any(n is not None and n.per_head for n in (spec.q_norm, spec.k_norm)):
        fwd.append("# q/k norms per head, as the source applies them")
    for norm, var, heads in (
        (spec.q_norm, "q", "self.num_heads"),
        (spec.k_norm, "k", "self.num_kv_heads"),
    ):
        if norm is None:
            continue
        if norm.per_head:
            fwd.append(
                f"{var} = self.{norm.attr}({var}.view(-1, {heads}, {hd})).view({var}.shape)"
            )
        else:
            fwd.append(f"{var} = self._whole_projection_norm(self.{norm.attr}, {var})")
    methods = ""
    if any(n is not None and not n.per_head for n in (spec.q_norm, spec.k_norm)):
        body += [
            "self.tp_rank = get_tensor_model_parallel_rank()",
            "self.tp_size = tp_size",
            "# a norm over the whole k projection needs each rank's own kv heads",
            "assert tp_size == 1 or self.total_num_kv_heads % tp_size == 0",
        ]
        methods = WHOLE_PROJECTION_NORM
    fwd += [
        "q, k = self.rotary_emb(positions, q, k)",
        "attn_output = self.attn(q, k, v)",
        f"output, _ = self.{spec.out_proj}(attn_output)",
        "return output",
    ]
    return f"""
class {info.name}(nn.Module):
    def __init__({signature(info, ATTENTION_EXTRAS)}) -> None:
{indent(body)}

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
{indent(fwd)}
{methods}"""
