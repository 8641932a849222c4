"""Engine-free: each fused module of generated/qwen3.py against its transformers
counterpart, on the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch

from conftest import build_loaded

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
ATOL = 1e-5


@pytest.fixture(scope="module")
def loaded(vllm_engine_free, qwen3_checkpoint):
    from generated.qwen3 import Qwen3ForCausalLM

    ckpt, hf = qwen3_checkpoint
    model, names, weights = build_loaded(Qwen3ForCausalLM, vllm_engine_free, ckpt)
    return model, names, weights, hf


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_every_checkpoint_tensor_is_loaded(loaded):
    model, names, weights, _ = loaded
    params = set(dict(model.named_parameters()))
    # every merged parameter was filled, and nothing of the model was left unloaded
    assert params <= names, sorted(params - names)
    assert any(n.endswith("qkv_proj.weight") for n in names)
    assert any(n.endswith("gate_up_proj.weight") for n in names)


@torch.no_grad()
def test_glu_mlp_matches(loaded):
    model, _, _, hf = loaded
    x = torch.randn(7, hf.config.hidden_size)
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        assert rel_err(ours.mlp(x), theirs.mlp(x[None])[0]) <= ATOL


@torch.no_grad()
def test_qkv_projection_and_head_norms_match(loaded):
    model, _, _, hf = loaded
    x = torch.randn(5, hf.config.hidden_size)
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        a, b = ours.self_attn, theirs.self_attn
        qkv, _ = a.qkv_proj(x)
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        assert rel_err(v, b.v_proj(x)) <= ATOL
        hd = b.head_dim
        want_q = b.q_norm(b.q_proj(x).view(5, -1, hd)).reshape(5, -1)
        want_k = b.k_norm(b.k_proj(x).view(5, -1, hd)).reshape(5, -1)
        got_q = a.q_norm(q.view(-1, a.num_heads, hd)).view(q.shape)
        got_k = a.k_norm(k.view(-1, a.num_kv_heads, hd)).view(k.shape)
        assert rel_err(got_q, want_q) <= ATOL
        assert rel_err(got_k, want_k) <= ATOL


@torch.no_grad()
def test_fused_residual_norm_matches_add_then_norm(loaded):
    model, _, _, hf = loaded
    h, residual = torch.randn(2, 4, hf.config.hidden_size)
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        for name in ("input_layernorm", "post_attention_layernorm"):
            out, new_residual = getattr(ours, name)(h.clone(), residual.clone())
            assert rel_err(new_residual, h + residual) <= ATOL
            assert rel_err(out, getattr(theirs, name)(h + residual)) <= ATOL
    out, _ = model.model.norm(h.clone(), residual.clone())
    assert rel_err(out, hf.model.norm(h + residual)) <= ATOL


@torch.no_grad()
def test_embedding_and_head_match(loaded):
    model, _, _, hf = loaded
    ids = torch.tensor([0, 3, 17, 511])
    assert torch.equal(model.model.embed_tokens(ids), hf.model.embed_tokens(ids))
    h = torch.randn(4, hf.config.hidden_size)
    logits = model.compute_logits(h)
    assert rel_err(logits, hf.lm_head(h)) <= ATOL
