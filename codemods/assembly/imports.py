"""The generated file's imports: only the names the emitted code uses, grouped
stdlib / torch / transformers / vllm."""

from __future__ import annotations

import re

# (module, names): only the names the emitted classes use are imported.
IMPORTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("collections.abc", ("Iterable",)),
    ("copy", ("copy", "copy as shallow_copy")),
    ("functools", ("partial",)),
    ("transformers.activations", ("ACT2CLS", "ACT2FN")),
    ("transformers.core_model_loading", ("WeightRenaming",)),
    ("itertools", ("islice",)),
    ("torch", ("nn",)),
    ("types", ("SimpleNamespace",)),
    ("vllm.compilation.decorators", ("support_torch_compile",)),
    ("vllm.config", ("CacheConfig", "VllmConfig", "get_current_vllm_config")),
    (
        "vllm.distributed",
        (
            "get_pp_group",
            "get_tensor_model_parallel_rank",
            "get_tensor_model_parallel_world_size",
            "split_tensor_along_last_dim",
            "tensor_model_parallel_all_gather",
        ),
    ),
    ("vllm.model_executor.layers.activation", ("get_act_and_mul_fn", "get_act_fn")),
    (
        "vllm.model_executor.layers.attention",
        ("Attention", "Attention as VllmAttention"),
    ),
    (
        "vllm.model_executor.layers.attention.chunked_local_attention",
        ("ChunkedLocalAttention",),
    ),
    ("vllm.model_executor.layers.attention_layer_base", ("AttentionLayerBase",)),
    ("vllm.model_executor.layers.fused_moe", ("FusedMoEFactory", "GateLinear")),
    ("vllm.model_executor.layers.layernorm", ("GemmaRMSNorm", "RMSNorm")),
    (
        "vllm.model_executor.layers.linear",
        (
            "ColumnParallelLinear",
            "MergedColumnParallelLinear",
            "QKVParallelLinear",
            "ReplicatedLinear",
            "RowParallelLinear",
        ),
    ),
    ("vllm.model_executor.layers.logits_processor", ("LogitsProcessor",)),
    ("vllm.model_executor.layers.mamba.mamba_mixer", ("MambaMixer",)),
    ("vllm.model_executor.layers.mamba.mamba_mixer2", ("MambaMixer2",)),
    (
        "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
        ("QwenGatedDeltaNetAttention",),
    ),
    (
        "vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn",
        ("OlmoHybridGatedDeltaNetAttention",),
    ),
    (
        "vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d",
        ("causal_conv1d_fn_cpu", "causal_conv1d_update_cpu"),
    ),
    ("vllm", ("_custom_ops as vllm_ops",)),
    (
        "vllm.model_executor.layers.mamba.mamba_utils",
        (
            "MambaStateCopyFuncCalculator",
            "MambaStateDtypeCalculator",
            "MambaStateShapeCalculator",
            "is_conv_state_dim_first",
        ),
    ),
    (
        "vllm.model_executor.layers.mamba.ops.causal_conv1d",
        (
            "causal_conv1d_fn as vllm_causal_conv1d_fn",
            "causal_conv1d_update as vllm_causal_conv1d_update",
        ),
    ),
    ("vllm.model_executor.layers.mamba.short_conv", ("ShortConv",)),
    (
        "vllm.model_executor.layers.mla",
        ("MLAModules", "MultiHeadLatentAttentionWrapper"),
    ),
    ("vllm.forward_context", ("get_forward_context",)),
    ("vllm.model_executor.layers.quantization", ("QuantizationConfig",)),
    ("vllm.model_executor.layers.rotary_embedding", ("get_rope",)),
    (
        "vllm.model_executor.model_loader.weight_utils",
        ("default_weight_loader", "sharded_weight_loader"),
    ),
    ("vllm.model_executor.utils", ("set_weight_attrs",)),
    (
        "vllm.model_executor.layers.vocab_parallel_embedding",
        ("ParallelLMHead", "VocabParallelEmbedding"),
    ),
    # vLLM's loader for experts held interleaved [hidden, 2 * intermediate] (gpt-oss's)
    ("vllm.model_executor.models.gpt_oss", ("GptOssRoutedExperts",)),
    (
        "vllm.model_executor.models.interfaces",
        (
            "HasInnerState",
            "IsAttentionFree",
            "IsHybrid",
            "SupportsLoRA",
            "SupportsPP",
            "SupportsQuant",
        ),
    ),
    (
        "vllm.model_executor.models.transformers.moe",
        ("TransformersMoERunner", "TransformersMoEState"),
    ),
    (
        "vllm.model_executor.models.utils",
        (
            "AutoWeightsLoader",
            "PPMissingLayer",
            "WeightsMapper",
            "extract_layer_index",
            "make_empty_intermediate_tensors_factory",
            "make_layers",
            "maybe_prefix",
        ),
    ),
    ("vllm.platforms", ("current_platform",)),
    ("vllm.sequence", ("IntermediateTensors",)),
)


# names whose plain use is too loose a test: `copy(` the function, not `copy.deepcopy`
_USE = {"copy": r"(?<![\w.])copy\(", "partial": r"(?<![\w.])partial\("}


def imports_for(body: str, defined: set[str] = frozenset()) -> str:
    """Import lines for the names `body` uses, grouped stdlib / torch / vllm; names
    `body` defines itself (a source class called `Attention`) are not imported."""
    groups: dict[str, list[str]] = {
        "std": [
            f"import {name}"
            for name in ("math", "re")
            if re.search(rf"\b{name}\.", body)
        ],
        "torch": ["import torch"],
        "transformers": [],
        "vllm": [],
    }
    for module, names in IMPORTS:
        # "name as alias" entries are found by their alias
        used = [
            n
            for n in names
            if n not in defined
            and re.search(_USE.get(n, rf"\b{n.split(' as ')[-1]}\b"), body)
        ]
        if used:
            group = module.split(".")[0] if module.split(".")[0] in groups else "std"
            groups[group].append(f"from {module} import {', '.join(used)}")
    return "\n\n".join("\n".join(lines) for lines in groups.values() if lines) + "\n"
