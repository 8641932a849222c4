"""The latent attention's proof: the source module on random inputs against MLA
written out on its own weights.

    q = q_b(q_norm(q_a(x))) | q_proj(x);  [c; k_rot] = kv_a(x);  [k_nope; v] = kv_b(kv_norm(c))
    rope on q's last `rope_dim` dims and on k_rot (shared by every head), scores scaled
    by the module's own `scaling`, causal softmax, o_proj.
"""

from __future__ import annotations

from ..base import PatternRefused, code
from .match import MLASpec

def prove(spec: MLASpec, module, call: dict, config, rope_parameters: dict) -> None:
    import torch

    from ..dataflow import require_close

    if rope_parameters.get("rope_type", "default") != "default":
        raise PatternRefused(
            f"rope type {rope_parameters['rope_type']!r} for latent attention is not emitted yet"
        )
    neox = bool(eval(code(spec.neox), {"self": module, "config": config}))  # noqa: S307
    hidden = call["hidden_states"]
    S = hidden.shape[1]
    x = hidden[0]
    kv_lora, rope = (getattr(module, a) for a in (spec.kv_lora_rank, spec.rope_dim))
    with torch.no_grad():
        got = module(**call)[0][0]
        if getattr(module, spec.q_a) is None:  # no q low-rank in this config
            q = getattr(module, spec.q_proj)(x)
        else:
            q_a, q_norm, q_b = (
                getattr(module, a) for a in (spec.q_a, spec.q_norm, spec.q_b)
            )
            q = q_b(q_norm(q_a(x)))
        kv_b = getattr(module, spec.kv_b)
        c, k_rot = getattr(module, spec.kv_a)(x).split([kv_lora, rope], -1)
        kv = kv_b(getattr(module, spec.kv_norm)(c))
        head_count = config.num_attention_heads
        q = q.view(S, head_count, -1)
        qk_head = q.shape[-1]
        nope = qk_head - rope
        kv = kv.view(S, head_count, -1)
        k_nope, v = kv.split([nope, kv.shape[-1] - nope], -1)
        q_nope, q_rot = q.split([nope, rope], -1)
        theta = rope_parameters["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, rope, 2).float() / rope))
        angle = torch.arange(S)[:, None].float() * inv

        def rotate(t):
            cos, sin = angle.cos(), angle.sin()
            if t.dim() == 3:
                cos, sin = cos[:, None], sin[:, None]
            if neox:
                t1, t2 = t[..., : rope // 2], t[..., rope // 2 :]
                return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)
            t1, t2 = t[..., 0::2], t[..., 1::2]
            return torch.stack([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1).flatten(
                -2
            )

        q_rot, k_rot = rotate(q_rot), rotate(k_rot)
        scores = (
            torch.einsum("shd,thd->hst", q_nope, k_nope)
            + torch.einsum("shd,td->hst", q_rot, k_rot)
        ) * module.scaling
        scores = scores + torch.full((S, S), float("-inf")).triu(1)
        out = torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(S, -1)
        want = getattr(module, spec.o_proj)(out)
    require_close(want, got, f"{spec.class_name} as latent attention")
