"""What the generated file will hold for a proven Mamba-2 mixer: vLLM's `MambaMixer2`
built from the source's own expressions, and the causal LM's state methods (the shapes,
dtypes and copy functions of vLLM's state cache) from the same expressions, so the
cache and the layer can never disagree. Not wired into the pipeline yet (issue 38)."""

from __future__ import annotations

from ..base import code
from .match import Mamba2Spec

# MambaMixer2's keyword -> MambaStateShapeCalculator.mamba2_state_shape's
SHAPE_ARGS = {
    "intermediate_size": "intermediate_size",
    "n_groups": "n_groups",
    "num_heads": "num_heads",
    "head_dim": "head_dim",
    "ssm_state_size": "state_size",
    "conv_kernel_size": "conv_kernel",
}
ORDER = (
    "hidden_size",
    "ssm_state_size",
    "conv_kernel_size",
    "intermediate_size",
    "use_conv_bias",
    "use_bias",
    "n_groups",
    "num_heads",
    "head_dim",
    "rms_norm_eps",
    "activation",
)


def construction(spec: Mamba2Spec, prefix: str = 'f"{prefix}.mixer"') -> str:
    """`MambaMixer2(...)`, its arguments the source's expressions over `config`."""
    args = [f"{k}={code(spec.args[k])}" for k in ORDER]
    args += [
        "model_config=get_current_vllm_config().model_config",
        "cache_config=get_current_vllm_config().cache_config",
        "quant_config=quant_config",
        f"prefix={prefix}",
    ]
    return "MambaMixer2(" + ", ".join(args) + ")"


def state_methods(spec: Mamba2Spec) -> str:
    """The causal LM's classmethods vLLM sizes and copies the state cache with."""
    shape = ",\n            ".join(
        f"{arg}={code(spec.args[k])}" for k, arg in SHAPE_ARGS.items()
    )
    return f"""
    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return MambaStateDtypeCalculator.mamba2_state_dtype(
            vllm_config.model_config.dtype,
            vllm_config.cache_config.mamba_cache_dtype,
            vllm_config.cache_config.mamba_ssm_cache_dtype,
        )

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        # the expressions the mixer is built with, on the same config
        config = vllm_config.model_config.hf_text_config
        return MambaStateShapeCalculator.mamba2_state_shape(
            {shape},
            tp_world_size=vllm_config.parallel_config.tensor_parallel_size,
            num_spec=vllm_config.num_speculative_tokens,
        )

    @classmethod
    def get_mamba_state_copy_func(cls):
        return MambaStateCopyFuncCalculator.mamba2_state_copy_func()
"""
