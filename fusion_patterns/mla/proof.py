"""The latent attention's proof: the source module on random inputs against MLA
written out on its own weights.

    q = q_b(q_norm(q_a(x))) | q_proj(x);  [c; k_rot] = kv_a(x);  [k_nope; v] = kv_b(kv_norm(c))
    rope on q's last `rope_dim` dims and on k_rot (shared by every head), scores scaled
    by the module's own `scaling`, causal softmax, o_proj.
"""

from __future__ import annotations

from ..base import PatternRefused, code, refused_by
from .match import NAME, MLASpec


def _neox(spec: MLASpec, module, config) -> bool:
    """The rope style the source takes for this module and config."""
    return bool(eval(code(spec.neox), {"self": module, "config": config}))  # noqa: S307


def prove(spec: MLASpec, module, call: dict, config, rope_parameters: dict) -> None:
    import torch

    from ..dataflow import require_close

    if rope_parameters.get("rope_type", "default") != "default":
        raise PatternRefused(
            f"rope type {rope_parameters['rope_type']!r} for latent attention is not emitted yet"
        )
    neox = _neox(spec, module, config)
    hidden = call["hidden_states"]
    S = hidden.shape[1]
    rope = getattr(module, spec.rope_dim)
    theta = rope_parameters["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, rope, 2).float() / rope))
    angle = torch.arange(S)[:, None].float() * inv

    def rotate_one(t):
        cos, sin = angle.cos(), angle.sin()
        if t.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        if neox:
            t1, t2 = t[..., : rope // 2], t[..., rope // 2 :]
            return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1)
        t1, t2 = t[..., 0::2], t[..., 1::2]
        return torch.stack([t1 * cos - t2 * sin, t2 * cos + t1 * sin], -1).flatten(-2)

    with torch.no_grad():
        got = module(**call)[0][0]
    want = written_out(
        spec, module, hidden[0], config, lambda q, k: (rotate_one(q), rotate_one(k))
    )
    require_close(want, got, f"{spec.class_name} as latent attention")


def written_out(spec: MLASpec, module, x, config, rotate):
    """MLA on the module's own weights for one sequence `x` [tokens, hidden]: `rotate`
    takes the rope parts of q [tokens, heads, rope] and of the shared key [tokens, rope].
    """
    import torch

    S = x.shape[0]
    kv_lora, rope = (getattr(module, a) for a in (spec.kv_lora_rank, spec.rope_dim))
    with torch.no_grad():
        if getattr(module, spec.q_a) is None:  # no q low-rank in this config
            q = getattr(module, spec.q_proj)(x)
        else:
            q_a, q_norm, q_b = (
                getattr(module, a) for a in (spec.q_a, spec.q_norm, spec.q_b)
            )
            q = q_b(q_norm(q_a(x)) * _scale(module, spec.q_scale))
        kv_b = getattr(module, spec.kv_b)
        c, k_rot = getattr(module, spec.kv_a)(x).split([kv_lora, rope], -1)
        c = getattr(module, spec.kv_norm)(c) * _scale(module, spec.kv_scale)
        kv = kv_b(c)
        head_count = config.num_attention_heads
        q = q.view(S, head_count, -1)
        qk_head = q.shape[-1]
        nope = qk_head - rope
        kv = kv.view(S, head_count, -1)
        k_nope, v = kv.split([nope, kv.shape[-1] - nope], -1)
        q_nope, q_rot = q.split([nope, rope], -1)
        q_rot, k_rot = rotate(q_rot, k_rot)
        scores = (
            torch.einsum("shd,thd->hst", q_nope, k_nope)
            + torch.einsum("shd,td->hst", q_rot, k_rot)
        ) * module.scaling
        scores = scores + torch.full((S, S), float("-inf")).triu(1)
        out = torch.einsum("hst,thd->shd", scores.softmax(-1), v).reshape(S, -1)
        return getattr(module, spec.o_proj)(out)


def _scale(module, attr: str | None) -> float:
    """A norm's output scale as the generated file folds it into the norm's weight."""
    return 1.0 if attr is None else float(getattr(module, attr))


# scaled rope for latent attention: each source rope type -> the vLLM rope types that
# may compute it, tried in order (vLLM's own deepseek_v2.py maps yarn to deepseek_yarn,
# whose kernel takes q as [tokens, heads, dim]; the flat q the MLA layer is handed here
# it broadcasts wrong, so vLLM's plain yarn comes first)
SCALED_ROPES = {"yarn": ("yarn", "deepseek_yarn")}
# the parameters the scaled rope is proven with: DeepSeek-V2's (mscale = mscale_all_dim,
# a factor of 40 over the pretrained length) and one with the two mscales apart
YARN_CASES = (
    {"factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707},
    {"factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5},
)


def _source_rope(model, call: dict):
    """The module whose output the attention was handed as `position_embeddings`."""
    import torch

    def same(a, b) -> bool:
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )

    handed = call.get("position_embeddings")
    if isinstance(handed, (tuple, list)) and handed:
        handed = handed[0]  # the probe keeps a module's first output
    for instances in model.probe.instances.values():
        for _, inst in instances:
            seen = model.call(inst)
            if seen is not None and same(seen[2], handed):
                return inst
    raise PatternRefused("the module computing its position embeddings is not found")


def _scaled_case(model, inst, rope_module, call: dict, source_type: str, case: dict):
    """(config, the source attention rebuilt with the scaled rope, its output on the
    tiny model's input) for one parameter case."""
    import copy

    import torch

    config = copy.deepcopy(model.config)
    original = config.max_position_embeddings
    config.max_position_embeddings = int(original * case["factor"])
    config.rope_parameters = {
        **config.rope_parameters,
        **case,
        "rope_type": source_type,
        "original_max_position_embeddings": original,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    module = type(inst)(config, inst.layer_idx).eval()
    module.load_state_dict(inst.state_dict())
    hidden = call["hidden_states"]
    with torch.no_grad():
        embeddings = type(rope_module)(config)(
            hidden, torch.arange(hidden.shape[1])[None]
        )
        got = module(**{**call, "position_embeddings": embeddings})[0][0]
    return config, module, got


def _computes(spec: MLASpec, case, target: str, x) -> None:
    """Raises unless MLA with vLLM's `target` rope computes the rebuilt source's output
    on the sequence `x` [tokens, hidden]."""
    import torch
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from ..dataflow import require_close

    config, module, got = case
    S = got.shape[0]
    positions = torch.arange(S)
    vllm_rope = get_rope(
        getattr(module, spec.rope_dim),
        max_position=config.max_position_embeddings,
        rope_parameters={**config.rope_parameters, "rope_type": target},
        is_neox_style=_neox(spec, module, config),
        dtype=torch.float32,
    )

    def rotate(q, k):
        shape = q.shape
        q, k = vllm_rope.forward_native(positions, q.reshape(S, -1), k.reshape(S, -1))
        return q.view(shape), k

    want = written_out(spec, module, x, config, rotate)
    require_close(want, got, f"{spec.class_name} with {target} rope")


def scaled_ropes(
    spec: MLASpec, model, inst, call: dict
) -> tuple[dict[str, str], dict[str, str]]:
    """{source rope type: vLLM rope type} for each scaled rope the source module,
    rebuilt with it, computes as MLA with vLLM's rope of that type (on every case),
    and {source rope type: why none does} for the others."""
    rope_module = _source_rope(model, call)
    out, why = {}, {}
    for source_type, targets in SCALED_ROPES.items():
        try:  # the source side once per case, whichever vLLM rope it is held against
            cases = [
                _scaled_case(model, inst, rope_module, call, source_type, case)
                for case in YARN_CASES
            ]
        except Exception as exc:  # noqa: BLE001 - the source cannot be rebuilt so
            why[source_type] = refused_by(exc, NAME, spec.class_name, "rope").reason
            continue
        for target in targets:
            try:
                for case in cases:
                    _computes(spec, case, target, call["hidden_states"][0])
            except (
                Exception
            ) as exc:  # noqa: BLE001 - this vLLM rope does not compute it
                reason = refused_by(exc, NAME, spec.class_name, "rope").reason
                why.setdefault(source_type, f"{target}: {reason}")
                continue
            out[source_type] = target
            why.pop(source_type, None)
            break
    return out, why
