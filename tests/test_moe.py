"""MoE blocks -> vLLM's fused MoE layer and latent attention -> vLLM's MLA layer
(qwen3_moe, mixtral, deepseek_v3): what is matched, what the proofs refuse, and which
checkpoint names reach the fused layer's loader, for both layouts (the published
per-expert tensors and transformers' in-memory stacked ones). The last tests run real
vLLM.
"""

from __future__ import annotations

import importlib
import json

import pytest

from conftest import REPO, edited_modeling_file, run_cli
from codemods import tiny
from fusion_patterns import glu, moe
from fusion_patterns.base import code

MODELS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


def _claimed(name: str):
    """The claims stage's model for one source: {class: spec} of every claim, and it."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from codemods.pipeline import claimed

    with set_current_vllm_config(VllmConfig()):
        model = claimed(name)
    return {c.class_name: c.spec for c in model.claims}, model


def test_qwen3_moe_builds_a_moe_block_or_a_dense_mlp_per_layer():
    specs, _ = _claimed("modeling_qwen3_moe.py")
    block = specs["Qwen3MoeSparseMoeBlock"]
    assert isinstance(block, moe.MoESpec)
    assert isinstance(specs["Qwen3MoeMLP"], glu.GLUSpec)
    # read from the router and experts classes, in the block's own names
    assert (block.router_attr, block.experts_attr) == ("gate", "experts")
    assert [
        code(e)
        for e in (
            block.num_experts,
            block.top_k,
            block.hidden,
            block.intermediate,
            block.renormalize,
            block.activation,
        )
    ] == [
        "config.num_experts",
        "config.num_experts_per_tok",
        "config.hidden_size",
        "config.moe_intermediate_size",
        "config.norm_topk_prob",
        "config.hidden_act",
    ]
    assert block.router.flag == "norm_topk_prob"


def test_mixtral_always_renormalises():
    specs, _ = _claimed("modeling_mixtral.py")
    (block,) = [b for b in specs.values() if isinstance(b, moe.MoESpec)]
    assert code(block.renormalize) == "True" and block.router.flag is None
    assert code(block.num_experts) == "config.num_local_experts"
    assert code(block.intermediate) == "config.intermediate_size"


def _apply(path, tmp_path):
    return run_cli(
        "codemods.apply",
        str(path),
        "--trust-remote-code",
        "--out",
        str(tmp_path / "out"),
    )


def test_the_proof_routes_with_vllm_s_function_uncompiled():
    """The proof runs vLLM's `grouped_topk` (a torch.compile'd function) eagerly: no
    graph is compiled (compiling cost each MoE file seconds per routing flag set), and
    the routing is softmax top-k, renormalised, as the function computes it."""
    import torch
    from torch._dynamo.utils import counters

    from fusion_patterns.moe.proof import fused_reference

    torch.manual_seed(0)
    x, logits = torch.randn(5, 8), torch.randn(5, 4)
    gate_up, down = torch.randn(4, 6, 8), torch.randn(4, 8, 3)

    def act_and_mul(h):
        return torch.nn.functional.silu(h[..., :3]) * h[..., 3:]

    before = counters["stats"]["unique_graphs"]
    out = fused_reference(
        x,
        logits,
        gate_up,
        down,
        act_and_mul,
        {
            "topk": 2,
            "renormalize": True,
            "scoring_func": "softmax",
            "num_expert_group": 1,
            "topk_group": 1,
        },
    )
    assert counters["stats"]["unique_graphs"] == before
    weights, chosen = torch.softmax(logits, -1).topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    expected = torch.stack(
        [
            sum(
                w * (act_and_mul(x[t] @ gate_up[e].T) @ down[e].T)
                for w, e in zip(weights[t], chosen[t])
            )
            for t in range(5)
        ]
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "old,new,reason",
    [
        (  # a routed scaling factor vLLM would not apply: the proof catches it
            "router_top_value = router_top_value.to(router_logits.dtype)",
            "router_top_value = (router_top_value * 2.5).to(router_logits.dtype)",
            "the fused form differs",
        ),
        (  # a softmax temperature vLLM would not apply
            "router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)",
            "router_probs = torch.nn.functional.softmax(router_logits * 2.0, dtype=torch.float, dim=-1)",
            "the fused form differs",
        ),
        (
            "        if self.norm_topk_prob:\n            router_top_value /=",
            "        if not self.norm_topk_prob:\n            router_top_value /=",
            "guarded by `not self.norm_topk_prob`",
        ),
    ],
    ids=["scaled-weights", "temperature", "inverted-flag"],
)
def test_a_router_vllm_would_compute_differently_is_refused(tmp_path, old, new, reason):
    """The fusion is refused with its reason; the model is still generated (faithful
    layout), the block kept as the source routes it."""
    result = _apply(
        edited_modeling_file(tmp_path, "modeling_qwen3_moe.py", old, new), tmp_path
    )
    assert result.returncode == 0, result.stderr[-2000:]
    refused = [
        line
        for line in result.stderr.splitlines()
        if line.startswith("Refused: router + experts (Qwen3MoeSparseMoeBlock)")
    ]
    assert refused and all(reason in line for line in refused), result.stderr[-2000:]
    text = (tmp_path / "out" / "qwen3_moe.py").read_text()
    assert "FusedMoE(" not in text  # the source's own routing and experts
    assert "Unfused: module (Qwen3MoeSparseMoeBlock): copied from the source" in text


def test_an_unconditional_renormalisation_is_fused_as_such(tmp_path):
    path = edited_modeling_file(
        tmp_path,
        "modeling_qwen3_moe.py",
        "        if self.norm_topk_prob:\n            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)",
        "        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)",
    )
    result = _apply(path, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    text = (tmp_path / "out" / "qwen3_moe.py").read_text()
    assert "renormalize=True," in text and "config.norm_topk_prob" not in text


def test_a_sigmoid_router_is_fused_with_sigmoid_scoring(tmp_path):
    path = edited_modeling_file(
        tmp_path,
        "modeling_qwen3_moe.py",
        "router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)",
        "router_probs = torch.sigmoid(router_logits.float())",
    )
    result = _apply(path, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert 'scoring_func="sigmoid",' in (tmp_path / "out" / "qwen3_moe.py").read_text()


def test_deepseek_v3_routing_and_latent_attention_are_read_from_the_source():
    specs, model = _claimed("modeling_deepseek_v3.py")
    block = specs["DeepseekV3MoE"]
    assert dict(block.routing) == {
        "scoring_func": "'sigmoid'",
        "e_score_correction_bias": "self.gate.e_score_correction_bias",
        "use_grouped_topk": "True",
        "num_expert_group": "config.n_group",
        "topk_group": "config.topk_group",
        "routed_scaling_factor": "config.routed_scaling_factor",
    }
    assert (block.shared_attr, block.shared_class) == (
        "shared_experts",
        "DeepseekV3MLP",
    )
    # the shared experts' stacking is scoped to their own path
    assert model.roles.scopes["DeepseekV3MLP"] == ["mlp", "mlp.shared_experts"]
    a = specs["DeepseekV3Attention"][0]  # (spec, emitted class, arity)
    assert (a.q_a, a.q_norm, a.q_b, a.q_proj) == (
        "q_a_proj",
        "q_a_layernorm",
        "q_b_proj",
        "q_proj",
    )
    assert (a.kv_a, a.kv_norm, a.kv_b, a.o_proj) == (
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
        "o_proj",
    )
    assert code(a.neox) == "not self.config.rope_interleave"


def test_the_rope_style_is_read_from_the_source(tmp_path):
    """Both branches rotating halves (GPT-NeoX style): the generated rope is neox-style."""
    path = edited_modeling_file(
        tmp_path,
        "modeling_deepseek_v3.py",
        "q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin)",
        "q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, cos, sin)",
    )
    result = _apply(path, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    text = (tmp_path / "out" / "deepseek_v3.py").read_text()
    assert "is_neox_style=True," in text and "rope_interleave" not in text


def test_latent_attention_without_its_latent_norm_is_refused(tmp_path):
    path = edited_modeling_file(
        tmp_path,
        "modeling_deepseek_v3.py",
        "        kv_nope = self.kv_a_layernorm(kv_nope)\n",
        "",
    )
    result = _apply(path, tmp_path)
    # vLLM's MLA layer would norm the latent: refused with the reason, and the attention
    # emitted as the source computes it instead, the other parts still fused
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        "Refused: latent attention (DeepseekV3Attention): the latent `kv_nope` is not "
        "normed once by a proven norm" in result.stderr
    ), result.stderr[-2000:]
    assert "Fused: gate + experts (DeepseekV3MoE)" in result.stderr
    text = (tmp_path / "out" / "deepseek_v3.py").read_text()
    assert (
        "Unfused: attention (DeepseekV3Attention): kept as the source computes it"
        in text
    )
    assert "MultiHeadLatentAttentionWrapper" not in text


def test_latent_attention_scales_are_read_from_the_dataflow():
    """LongCat multiplies its query (both parts) and its normed latent by constants;
    DeepSeek-V3 does not: the match names the scalars by where the values flow from,
    and the committed LongCat file folds them into the norms' weights at load (no
    VLLM_MLA_DISABLE: vLLM's latent cache)."""
    from codemods.source import load
    from fusion_patterns.mla.match import match

    norms = {"LongcatFlashRMSNorm", "DeepseekV3RMSNorm"}
    longcat = load("modeling_longcat_flash.py")
    spec = match(longcat.classes["LongcatFlashMLA"], norms, longcat.module)
    assert (spec.q_scale, spec.kv_scale) == ("mla_scale_q_lora", "mla_scale_kv_lora")
    deepseek = load("modeling_deepseek_v3.py")
    spec = match(deepseek.classes["DeepseekV3Attention"], norms, deepseek.module)
    assert (spec.q_scale, spec.kv_scale) == (None, None)
    text = (REPO / "generated" / "longcat_flash.py").read_text()
    assert "_load_scaled(self.q_a_layernorm, self.mla_scale_q_lora)" in text
    assert "_load_scaled(self.kv_a_layernorm, self.mla_scale_kv_lora)" in text
    assert "MultiHeadLatentAttentionWrapper(" in text
    assert "VLLM_MLA_DISABLE" not in text


def test_a_latent_attention_scaling_part_of_its_query_is_refused(tmp_path):
    """Folding the query's scale into its norm scales all of it: a source scaling only
    the query's non-rotated part computes something else, and the proof says so."""
    path = edited_modeling_file(
        tmp_path,
        "modeling_longcat_flash.py",
        "        q_rot = q_rot * self.mla_scale_q_lora\n",
        "",
    )
    result = _apply(path, tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (
        "Refused: latent attention (LongcatFlashMLA): LongcatFlashMLA as latent "
        "attention: the fused form differs" in result.stderr
    ), result.stderr[-2000:]
    text = (tmp_path / "out" / "longcat_flash.py").read_text()
    assert "MultiHeadLatentAttentionWrapper" not in text
    assert "VLLM_MLA_DISABLE=1" in text


def _expert_keys(tmp_path, arch: str, layout: str) -> list[str]:
    from safetensors import safe_open

    import transformers

    causal_cls = getattr(transformers, MODELS[arch])
    ckpt = tmp_path / f"{arch}-{layout}"
    tiny.build_checkpoint(
        causal_cls, tiny.tiny_config(causal_cls.config_class), ckpt, layout=layout
    )
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return [k for k in f.keys() if ".experts." in k]


@pytest.mark.parametrize("layout", tiny.LAYOUTS)
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_every_expert_tensor_reaches_the_fused_moe_loader(tmp_path, arch, layout):
    """The generated mapper, applied as vLLM applies it, turns every expert tensor into a name vLLM's fused MoE loader takes, and the dense
    MLP's stacking rule never catches an expert's own gate_proj/up_proj."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    keys = _expert_keys(tmp_path, arch, layout)
    assert keys
    if layout == "saved":  # the published layout: one tensor per expert
        assert not any(k.endswith(".experts.gate_up_proj") for k in keys)
        assert all(any(f".experts.{e}." in k for k in keys) for e in range(4))
    else:
        assert any(k.endswith(".experts.gate_up_proj") for k in keys)
    module = importlib.import_module(f"generated.{arch}")
    causal = getattr(module, MODELS[arch])
    accepted = [
        weight
        for _, weight, _, _ in RoutedExperts.build_expert_params_mapping(
            "gate_proj", "down_proj", "up_proj", num_experts=4, include_fused=True
        )
    ]
    for key in keys:
        name, shard = causal.hf_to_vllm_mapper._map_name_with_shard(key)
        assert shard is None, (key, name)  # no dense stacking rule fired
        assert ".mlp.experts." in name, (key, name)
        relative = name.partition(".mlp.")[2]
        assert any(weight in relative for weight in accepted), (key, name)


# --- real vLLM -----------------------------------------------------------------------


YARN_V2 = [
    "--override",
    'rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, '
    '"original_max_position_embeddings": 64, "mscale": 0.707, "mscale_all_dim": 0.707, '
    '"beta_fast": 32, "beta_slow": 1}',
    "--override",
    "max_position_embeddings=2560",
]


def verify_json(*args: str) -> tuple[int, dict]:
    result = run_cli("codemods.verify", *args)
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "{}"
    return result.returncode, json.loads(last)


@pytest.mark.engine
@pytest.mark.parametrize(
    "arch,args",
    [
        # one parallel layout per model here; every model at TP=2 and PP=2 is
        # `python scripts/parallel_sweep.py`
        ("qwen3_moe", ["--tp", "2"]),
        ("qwen3_moe", ["--layout", "in-memory"]),
        ("qwen3_moe", ["--override", "decoder_sparse_step=2"]),
        ("mixtral", ["--pp", "2"]),
        ("mixtral", ["--layout", "in-memory"]),
        ("deepseek_v3", ["--tp", "2"]),
        # DeepSeek-V2-Lite's shape: no q low-rank, yarn rope over 40x its trained length
        ("deepseek_v2", ["--override", "q_lora_rank=null", *YARN_V2]),
    ],
    ids=lambda v: v if isinstance(v, str) else "-".join(v).strip("-"),
)
def test_moe_models_match_transformers_in_vllm(arch, args):
    rc, out = verify_json(arch, *args)
    assert rc == 0 and out["ok"] is True, out
    causal = {**MODELS, "deepseek_v2": "DeepseekV2ForCausalLM"}[arch]
    assert out["impl"] == f"generated.{arch}:{causal}"
    assert out["tokens_equal"] and out["max_abs_logprob_diff"] <= 1e-4
    if "--tp" in args:
        # experts and attention sharded, measured; DeepSeek-V3's latent down-projections
        # are one GEMM every rank holds whole, as in vLLM's own file (the generated
        # file says so), a large share of so tiny a model (0.69 at TP=2)
        whole = (
            (REPO / "generated" / f"{arch}.py").read_text().count("one replicated GEMM")
        )
        assert out["rank_share"] <= (0.75 if whole else 0.6), out
    if "--layout" in args:
        assert out["layout"] == "in-memory"
    if arch == "qwen3_moe":
        assert "norm_topk_prob" in out["features"]
        assert "mlp_only_layers=[1]" in out["features"]
