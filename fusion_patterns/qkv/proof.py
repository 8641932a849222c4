"""The proofs of the q/k/v patterns on the module the tiny model built.

Dataflow (torch.fx): q, k and v read one graph node nothing mutates in place; the
attention call's query, key and value come from q, k and v (the roles the rewrite gives
them); the output projection reads the attention output and nothing else. Numbers: the
merged GEMM split by the head counts gives the three projections; for the native
attention, what it computes (merged GEMM, split, per-head norms, vLLM's rope) against
the tensors the transformers module hands its attention call, and the output
projection on a given attention output against the module's own output.
"""

from __future__ import annotations

from ..base import PatternRefused, code
from .match import QKVSpec

CAPTURE = "codemods_capture"


def prove(
    spec: QKVSpec,
    module,
    call_kwargs: dict,
    config,
    rope_parameters: dict,
    neox: bool,
    proven_norms: set[str],
) -> None:
    prove_dataflow(spec, module)
    _prove_numbers(
        spec, module, call_kwargs, config, rope_parameters, neox, proven_norms
    )


def prove_dataflow(spec: QKVSpec, module, concrete: dict | None = None) -> None:
    """q, k and v read one graph node nothing mutates; the attention call's query, key
    and value come from q, k and v; the output projection reads only the attention.
    `concrete`: forward parameters traced at a value (see `dataflow.trace`)."""
    from ..dataflow import mutated_in_place, single_call, trace, upstream_linears

    graph = trace(module, concrete)
    q, k, v = (single_call(graph, p) for p in spec.projections)
    source = q.args[0]
    if not (source is k.args[0] is v.args[0]):
        raise PatternRefused("the projections consume different graph nodes")
    if mutated := mutated_in_place(source):
        raise PatternRefused(
            f"the projections' input is mutated in place ({', '.join(mutated)})"
        )
    attention = [n for n in graph.nodes if n.meta.get("leaf_call")]
    if len(attention) != 1:
        raise PatternRefused("no single attention call in the traced forward")
    for role, arg, proj in zip(
        ("query", "key", "value"), attention[0].args[:3], spec.projections
    ):
        found = upstream_linears(arg, module)
        if found != {proj}:
            raise PatternRefused(
                f"the attention call's {role} comes from {sorted(found) or 'no projection'}, not {proj}"
            )
    out = single_call(graph, spec.out_proj)
    if upstream_linears(out.args[0], module) != set(spec.projections):
        raise PatternRefused(
            f"{spec.out_proj} reads something besides the attention output"
        )


def prove_merged_gemm(spec: QKVSpec, module, config) -> None:
    """The merged projection, split by the head counts the spec reads, gives exactly
    the three projections (the faithful attention keeps everything after them)."""
    import torch
    import torch.nn.functional as F

    from ..dataflow import require_close

    head_dim = getattr(module, spec.head_dim_attr)
    env = {"config": config, "self": module}
    heads, kv_heads = (
        eval(code(e), env) for e in (spec.num_heads, spec.num_kv_heads)  # noqa: S307
    )
    projs = [getattr(module, p) for p in spec.projections]
    weight = torch.cat([p.weight for p in projs])
    bias = torch.cat([p.bias for p in projs]) if projs[0].bias is not None else None
    if weight.shape[0] != (heads + 2 * kv_heads) * head_dim:
        raise PatternRefused("the projections' sizes do not match their head counts")
    x = torch.randn(5, projs[0].in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        parts = F.linear(x, weight, bias).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        for part, proj, role in zip(parts, projs, "qkv"):
            require_close(part, proj(x), f"{role} from the merged GEMM")


def reorder_interleaved(t, heads: int):
    """[q_h; k_h; v_h for each head h] -> [q; k; v] along the output dim (the same
    reorder the generated loader applies to the checkpoint)."""
    return t.view(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _prove_numbers(
    spec: QKVSpec,
    module,
    call_kwargs: dict,
    config,
    rope_parameters: dict,
    neox: bool,
    proven_norms: set[str],
) -> None:
    import torch
    import torch.nn.functional as F
    from transformers.modeling_utils import AttentionInterface

    from vllm.model_executor.layers.rotary_embedding import get_rope

    from ..dataflow import require_close
    from ..rms_norm import vllm_twin

    hidden = call_kwargs["hidden_states"]
    tokens = hidden.shape[1]
    head_dim = getattr(module, spec.head_dim_attr)
    env = {"config": config, "self": module}
    heads, kv_heads = (
        eval(code(e), env) for e in (spec.num_heads, spec.num_kv_heads)  # noqa: S307
    )
    if spec.packed:
        packed = getattr(module, spec.merged)
        weight, bias = packed.weight, packed.bias
        if spec.interleaved:
            weight, bias = (
                None if t is None else reorder_interleaved(t, heads)
                for t in (weight, bias)
            )
    else:
        projs = [getattr(module, p) for p in spec.projections]
        weight = torch.cat([p.weight for p in projs])
        bias = torch.cat([p.bias for p in projs]) if projs[0].bias is not None else None
    given = torch.randn(
        1, tokens, heads, head_dim, generator=torch.Generator().manual_seed(1)
    )
    seen: dict = {}

    def capture(mod, query, key, value, mask, **kwargs):
        seen.update(q=query, k=key, v=value)
        return given, None

    AttentionInterface.register(CAPTURE, capture)
    saved = module.config._attn_implementation
    module.config._attn_implementation = CAPTURE
    try:
        with torch.no_grad():
            theirs = module(**call_kwargs)[0]
    finally:
        module.config._attn_implementation = saved
    if not seen:
        raise PatternRefused("the attention interface was not called")

    with torch.no_grad():
        x = hidden[0]
        if weight.shape[0] != (heads + 2 * kv_heads) * head_dim:
            raise PatternRefused(
                "the projections' sizes do not match their head counts"
            )
        q, k, v = F.linear(x, weight, bias).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
        )
        for norm, name in ((spec.q_norm, "q"), (spec.k_norm, "k")):
            if norm is None:
                continue
            theirs_norm = getattr(module, norm.attr)
            if norm.norm_class in proven_norms:
                apply = vllm_twin(norm.spec, theirs_norm).forward_native
            else:  # emitted as the copied source class
                apply = theirs_norm
            t = q if name == "q" else k
            if norm.per_head:
                t = apply(t.reshape(tokens, -1, head_dim)).reshape(t.shape)
            else:
                t = apply(t)
            q, k = (t, k) if name == "q" else (q, t)
        rope = get_rope(
            head_dim,
            max_position=config.max_position_embeddings,
            is_neox_style=neox,
            rope_parameters=rope_parameters,
            dtype=torch.float32,
        )
        q, k = rope.forward_native(torch.arange(tokens), q, k)
        flat = (
            lambda t: t[0].transpose(0, 1).reshape(tokens, -1)
        )  # noqa: E731  [1,H,T,D] -> [T,H*D]
        require_close(q, flat(seen["q"]), "query (merged GEMM, head norm, rope)")
        require_close(k, flat(seen["k"]), "key (merged GEMM, head norm, rope)")
        require_close(v, flat(seen["v"]), "value (merged GEMM)")
        out = getattr(module, spec.out_proj)(given[0].reshape(tokens, -1))
        require_close(out, theirs[0], f"{spec.out_proj} on the attention output")
