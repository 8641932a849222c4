"""Each feature check can fail: switch one feature off in a copy of a generated model
and verification must then fail. All copies run in one process (one vLLM import)."""

from __future__ import annotations


import pytest

from conftest import FULL_SWEEP, REPO, verify_in_one_process

pytestmark = pytest.mark.engine

# (model, name, text in generated/<model>.py, replacement): each switches one feature off.
MUTATIONS = [
    (
        "qwen3",
        "o_proj bias dropped",
        'bias=config.attention_bias,\n            quant_config=quant_config,\n            prefix=f"{prefix}.o_proj"',
        'bias=False,\n            quant_config=quant_config,\n            prefix=f"{prefix}.o_proj"',
    ),
    (
        "qwen3",
        "q norm dropped",
        "        q = self.q_norm(q.view(-1, self.num_heads, self.head_dim)).view(q.shape)\n",
        "",
    ),
    (
        "qwen3",
        "sliding window dropped",
        "sliding_window = self.sliding_window\n",
        "sliding_window = None\n",
    ),
    (
        "qwen3",
        "tied head untied",
        "self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)",
        "pass",
    ),
    (
        "llama",
        "gate/up bias dropped",
        "[self.intermediate_size, self.intermediate_size],\n            bias=config.mlp_bias,",
        "[self.intermediate_size, self.intermediate_size],\n            bias=False,",
    ),
    (
        "mistral",
        "sliding window dropped",
        'sliding_window = getattr(self.config, "sliding_window", None)',
        "sliding_window = None",
    ),
    (
        "qwen2",
        "qkv bias dropped",
        "self.total_num_kv_heads,\n            bias=True,",
        "self.total_num_kv_heads,\n            bias=False,",
    ),
    (
        "granite",
        "residual multiplier dropped after the MLP",
        "hidden_states = self.mlp(hidden_states)\n        hidden_states = hidden_states * self.residual_multiplier\n",
        "hidden_states = self.mlp(hidden_states)\n",
    ),
    (
        "granite",
        "logits scaling dropped",
        "logits = logits / self.config.logits_scaling",
        "logits = logits",
    ),
    (
        "gemma",
        "embedding scale dropped",
        "return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)",
        "return super().forward(input_ids)",
    ),
    (
        "gemma2",
        "final logit soft-cap dropped",
        "if self.config.final_logit_softcapping is not None:",
        "if False:",
    ),
    (
        "gemma2",
        "post-attention norm dropped",
        "        hidden_states = self.post_attention_layernorm(hidden_states)\n",
        "",
    ),
    (
        "gemma3",
        "one rope for every layer type",
        "rope_parameters=config.rope_parameters[config.layer_types[layer_idx]]",
        'rope_parameters=config.rope_parameters["full_attention"]',
    ),
    (
        "olmo2",
        "whole-projection q norm dropped",
        "        q = self._whole_projection_norm(self.q_norm, q)\n",
        "",
    ),
    (
        "gpt_neox",
        "per-head packing loaded as [q; k; v]",
        "                if heads is not None:\n",
        "                if False:\n",
    ),
    (
        "qwen3_moe",
        "norm_topk_prob ignored",
        "renormalize=config.norm_topk_prob,",
        "renormalize=False,",
    ),
    (
        "qwen3_moe",
        "every layer MoE (mlp_only_layers ignored)",
        "if (layer_idx not in config.mlp_only_layers) and (",
        "if (layer_idx not in []) and (",
    ),
    (
        "deepseek_v3",
        "routed scaling factor dropped",
        "routed_scaling_factor=config.routed_scaling_factor,",
        "",
    ),
    (
        "deepseek_v3",
        "score correction bias dropped",
        "e_score_correction_bias=self.gate.e_score_correction_bias,",
        "",
    ),
    (
        "deepseek_v3",
        "shared experts dropped",
        "out = out + self.shared_experts(hidden_states)",
        "pass",
    ),
    (  # vLLM 0.32's CPU rotary kernel mis-rotates the [tokens, heads, dim] query MLA passes
        "deepseek_v3",
        "rope on the query's 3-D view",
        "q_out, k_out = self.rope(\n            positions, q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1)\n        )",
        "q_out, k_out = self.rope(positions, q, k)",
    ),
]


# The faithful tier: each of its carried-over arguments and kept computations, off.
MUTATIONS += [
    (
        # vaultgemma, not gpt2: on gpt2's tiny random weights the scale moves the
        # logprobs by only ~1e-4 (caught, but barely)
        "vaultgemma",
        "faithful attention scaling dropped",
        "self.head_dim,\n            self.scaling,\n            num_kv_heads=",
        "self.head_dim,\n            1.0,\n            num_kv_heads=",
    ),
    (
        "gpt2",
        "learned position embeddings dropped",
        "hidden_states = inputs_embeds + position_embeds.to(inputs_embeds.device)",
        "hidden_states = inputs_embeds",
    ),
    (
        "vaultgemma",
        "faithful attention soft-cap dropped",
        "logits_soft_cap=self.attn_logit_softcapping,",
        "",
    ),
    (
        "granite_swa",
        "faithful attention window dropped",
        "sliding_window = self.sliding_window\n",
        "sliding_window = None\n",
    ),
    (
        "granite_swa",
        "faithful attention sinks dropped",
        "sinks=self.sinks,",
        "",
    ),
    (
        "afmoe",
        "faithful router's renormalisation dropped",
        "        top_scores = top_scores / denominator\n",
        "",
    ),
    (
        "bloom",
        "own attention's ALiBi dropped",
        "alibi_slopes=alibi_slopes(self.num_heads * tp_size)[",
        "alibi_slopes=None and alibi_slopes(self.num_heads * tp_size)[",
    ),
    (
        "gpt_neo",
        "own attention's local window dropped",
        'sliding_window = config.window_size if self.attention_type == "local" else None',
        "sliding_window = None",
    ),
]

# the classes of bug no copy above plants: stacked shard ids, the activation, rope
# style and theta, norm eps, Gemma's `1 + w`, router top-k and scoring, the weights and
# the ids an external router hands the fused experts, attention sinks, the clamp of
# GPT-OSS's gate
BUG_CLASSES = [
    (
        "qwen3",
        "k and v shard ids swapped",
        '(".self_attn.qkv_proj.", "k"),\n            ".self_attn.v_proj.": (".self_attn.qkv_proj.", "v")',
        '(".self_attn.qkv_proj.", "v"),\n            ".self_attn.v_proj.": (".self_attn.qkv_proj.", "k")',
    ),
    (
        "qwen3",
        "another activation",
        "self.act_fn = get_act_and_mul_fn(config.hidden_act)",
        'self.act_fn = get_act_and_mul_fn("gelu")',
    ),
    (
        "qwen3",
        "rope pairs instead of halves",
        "is_neox_style=True,",
        "is_neox_style=False,",
    ),
    (
        "qwen3",
        "rope theta changed",
        "rope_parameters=config.rope_parameters,",
        'rope_parameters={**config.rope_parameters, "rope_theta": 10.0},',
    ),
    (
        "qwen3",
        "input norm eps changed",
        "self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)",
        "self.input_layernorm = RMSNorm(config.hidden_size, eps=1.0)",
    ),
    (
        "gemma",
        "norm weight applied as w, not 1 + w",
        "from vllm.model_executor.layers.layernorm import GemmaRMSNorm",
        "from vllm.model_executor.layers.layernorm import RMSNorm as GemmaRMSNorm",
    ),
    (
        "qwen3_moe",
        "router top-k changed",
        "top_k=config.num_experts_per_tok,",
        "top_k=1,",
    ),
    (
        "deepseek_v3",
        "router scoring softmax, not sigmoid",
        'scoring_func="sigmoid",',
        'scoring_func="softmax",',
    ),
    (
        "afmoe",
        "the source router's top-k weights ignored by the fused experts",
        "return gating_output, moe_state.topk_ids",
        "return torch.ones_like(gating_output), moe_state.topk_ids",
    ),
    (
        "afmoe",
        "top-k ids off by one expert",
        "return gating_output, moe_state.topk_ids",
        "return gating_output, (moe_state.topk_ids + 1) % config.num_experts",
    ),
    (
        "gpt_oss",
        "attention sinks dropped",
        "sinks=self.sinks,",
        "sinks=None,",
    ),
    (
        "gpt_oss",
        "the clamped interleaved gate run as plain silu",
        'activation="swigluoai",',
        'activation="silu",',
    ),
]

MUTATIONS.append(
    (
        "granitemoehybrid",
        "the Mamba-2 decay from the negated A_log (A = -exp(-A_log))",
        'name = name[: -len("A_log")] + "A"',
        'name, tensor = name[: -len("A_log")] + "A", -tensor',
    )
)

MUTATIONS.append(
    (
        "falcon_h1",
        "the mixer's per-part in-projection scales (mup vector) not folded",
        "scale = rows[:, None] * config.ssm_in_multiplier",
        "scale = config.ssm_in_multiplier",
    )
)

BUG_CLASSES.append(
    (
        "falcon",
        "kv heads the weights hold, where the keys are broadcast to every head",
        "total_kv_heads = (\n            self.num_heads if self.new_decoder_architecture "
        "else self.num_kv_heads\n        )",
        "total_kv_heads = self.num_kv_heads",
    )
)

MUTATIONS += BUG_CLASSES


# copies whose checkpoint no longer fits the model they build: vLLM's loader refuses them
# (the one way they can fail), by this message
LOAD_FAILURES = {
    "every layer MoE (mlp_only_layers ignored)": "There is no module or parameter named",
}


def engine_sample() -> list[tuple[str, str, str, str]]:
    """`make test`: every bug class, each other model's first copy (every model is
    edited once and run unedited) and each load failure (the other way a copy fails);
    the full sweep (scripts/engine_sweep.py): all."""
    if FULL_SWEEP:
        return MUTATIONS
    chosen = list(BUG_CLASSES)
    for mutation in MUTATIONS:
        if mutation[0] not in {m[0] for m in chosen} or mutation[1] in LOAD_FAILURES:
            chosen.append(mutation)
    return chosen


def test_every_copy_edits_its_committed_file_once_and_compiles():
    """Engine-free, for every copy (the engine runs a sample in `make test`): a copy the
    regenerated file no longer matches, or one that would crash, is found here."""
    for model, name, old, new in MUTATIONS:
        original = (REPO / "generated" / f"{model}.py").read_text()
        assert original.count(old) == 1, name
        compile(original.replace(old, new), name, "exec")


def test_verification_fails_for_each_feature_switched_off(tmp_path):
    """Each copy fails by the mismatch it plants (verify ran both and the numbers
    differ: exit 1), never by a crash or a refusal; each unedited file passes in the
    same harness, so the failure is the edit's."""
    mutations = engine_sample()
    paths = []
    for i, (model, name, old, new) in enumerate(mutations):
        original = (REPO / "generated" / f"{model}.py").read_text()
        assert original.count(old) == 1, name
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        mutated = original.replace(old, new)
        compile(
            mutated, name, "exec"
        )  # a broken copy would "fail" for the wrong reason
        (folder / f"{model}.py").write_text(mutated)
        paths.append(str(folder / f"{model}.py"))
    unedited = sorted({m[0] for m in mutations})
    for model in unedited:
        folder = tmp_path / f"unedited-{model}"
        folder.mkdir()
        (folder / f"{model}.py").write_text(
            (REPO / "generated" / f"{model}.py").read_text()
        )
        paths.append(str(folder / f"{model}.py"))
    results = verify_in_one_process(paths, timeout=3600)
    for model, result in zip(unedited, results[len(mutations) :]):
        assert result["ok"] is True and result["code"] == 0, (model, result)
        assert result["impl"].startswith(f"_verify_{model}_"), (model, result)
    for (model, name, _, _), result in zip(mutations, results):
        if name in LOAD_FAILURES:
            assert result["code"] == 2, (model, name, result)
            assert LOAD_FAILURES[name] in result["error"], (model, name, result)
            continue
        assert result["ok"] is False and result["code"] == 1, (model, name, result)
        assert result["impl"].startswith(f"_verify_{model}_"), (name, result)
        assert result["max_abs_logprob_diff"] > 1e-3 or not result["tokens_equal"], (
            name,
            result,
        )
