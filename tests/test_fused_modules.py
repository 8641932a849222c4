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


def test_every_checkpoint_tensor_is_loaded(vllm_engine_free, qwen3_checkpoint):
    """Each tensor of the checkpoint sits, value for value, where vLLM's own qwen3.py
    puts it: q/k/v stacked in that order in qkv_proj, gate/up in gate_up_proj, every
    other tensor under its own name (written out here, not read from the file)."""
    from generated.qwen3 import Qwen3ForCausalLM

    ckpt, hf = qwen3_checkpoint
    model, names, weights = build_loaded(
        Qwen3ForCausalLM, vllm_engine_free, ckpt, process=False  # before any repack
    )
    params = dict(model.named_parameters())
    assert set(params) <= names, sorted(set(params) - names)  # nothing left unloaded
    c = hf.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    inter = c.intermediate_size
    rows = {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, q + kv),
        "v_proj": ("qkv_proj", q + kv, q + 2 * kv),
        "gate_proj": ("gate_up_proj", 0, inter),
        "up_proj": ("gate_up_proj", inter, 2 * inter),
    }
    assert len(weights) > len(params)  # the stacked ones arrive as several tensors
    for name, tensor in weights.items():
        target, part = name, slice(None)
        for piece, (merged, start, stop) in rows.items():
            if f".{piece}." in name:
                target, part = name.replace(f".{piece}.", f".{merged}."), slice(
                    start, stop
                )
        assert target in params, name
        assert torch.equal(params[target].data[part], tensor), name


@torch.no_grad()
def test_glu_mlp_matches(loaded):
    model, _, _, hf = loaded
    x = torch.randn(7, hf.config.hidden_size)
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        assert rel_err(ours.mlp(x), theirs.mlp(x[None])[0]) <= ATOL


class _Capture(torch.nn.Module):
    """Stands in for vLLM's Attention: keeps what the attention module hands it."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.seen = width, None

    def forward(self, q, k, v):
        self.seen = (q, k, v)
        return torch.zeros(q.shape[0], self.width)


@torch.no_grad()
def test_qkv_projection_and_head_norms_match(loaded):
    """The generated attention's own forward (merged projection, per-head norms, rope)
    hands its attention the q, k, v transformers' Qwen3Attention computes."""
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    model, _, _, hf = loaded
    tokens = 5
    x = torch.randn(tokens, hf.config.hidden_size)
    positions = torch.arange(tokens)
    cos, sin = hf.model.rotary_emb(x[None], positions[None])
    for ours, theirs in zip(model.model.layers, hf.model.layers):
        a, b = ours.self_attn, theirs.self_attn
        hd = b.head_dim
        real, capture = a.attn, _Capture(a.num_heads * hd)
        a.attn = capture
        try:
            a(positions, x)
        finally:
            a.attn = real
        q, k, v = capture.seen
        want_q = b.q_norm(b.q_proj(x[None]).view(1, tokens, -1, hd)).transpose(1, 2)
        want_k = b.k_norm(b.k_proj(x[None]).view(1, tokens, -1, hd)).transpose(1, 2)
        want_q, want_k = apply_rotary_pos_emb(want_q, want_k, cos, sin)
        assert rel_err(q, want_q.transpose(1, 2).reshape(tokens, -1)) <= ATOL
        assert rel_err(k, want_k.transpose(1, 2).reshape(tokens, -1)) <= ATOL
        assert rel_err(v, b.v_proj(x)) <= ATOL


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
