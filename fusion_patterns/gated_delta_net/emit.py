"""What the gated-DeltaNet claim writes into the generated file besides the layer's
construction: the config holding the source's expressions, and, for a vLLM layer whose
core runs Triton kernels only (OLMo Hybrid's on vLLM 0.32), the same layer with its
core on vLLM's CPU ops where vLLM's CPU build has no such kernel. The proof runs these
very texts."""

# vLLM's layers read their sizes from config fields a config class may name otherwise
CONFIG = '''
def gated_delta_net_config(**fields) -> SimpleNamespace:
    """The config fields vLLM's gated-DeltaNet layer reads, from the source's own
    expressions (a config class may name them otherwise)."""
    return SimpleNamespace(**fields)
'''

# the gated delta rule over one forward's tokens with vLLM's CPU ops
RULE_ON_CPU = '''
def gated_delta_rule_on_cpu(
    layer, decodes, slots, starts, has_initial, conv_state, ssm_state, mixed_qkv, b, a, out
):
    """vLLM's CPU gated-delta-rule ops (the ones its Qwen layer runs) over one forward's
    tokens, decode requests first (one token each), then prefills: the causal conv with
    its state carried, beta = sigmoid(b) (doubled where the config allows negative
    eigenvalues), the chunked rule from each request's state slot (`starts`: the
    requests' first tokens, then the end)."""
    weight = getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None)
    if weight is None:  # vLLM packs a bf16 conv weight of width 4 for its C++ conv
        weight = layer.conv1d.weight.view(
            layer.conv1d.weight.size(0), layer.conv1d.weight.size(-1)
        )
    bias, act = layer.conv1d.bias, layer.activation
    ends = int(starts[decodes]), int(starts[-1])
    parts = []
    if decodes:
        x = causal_conv1d_update_cpu(
            mixed_qkv[: ends[0]], conv_state, weight, bias, activation=act,
            conv_state_indices=slots[:decodes],
        )
        parts.append((x, slice(0, ends[0]), slots[:decodes], starts[: decodes + 1]))
    if starts.numel() - 1 > decodes:
        idx, loc = slots[decodes : starts.numel() - 1], starts[decodes:] - ends[0]
        fresh = has_initial[decodes : starts.numel() - 1]
        x = causal_conv1d_fn_cpu(
            mixed_qkv[ends[0] : ends[1]].transpose(0, 1), weight, bias,
            conv_states=conv_state, query_start_loc=loc, cache_indices=idx,
            has_initial_state=fresh, activation=act,
        ).transpose(0, 1)
        if (~fresh).any():  # a request without a state starts from zeros
            ssm_state[idx[~fresh]] = 0
        parts.append((x, slice(*ends), idx, loc))
    for x, rows, idx, loc in parts:
        q, k, v = layer.rearrange_mixed_qkv(x.contiguous())
        g, beta = vllm_ops.fused_gdn_gating_cpu(
            A_log=layer.A_log.float(), a=a[rows].contiguous(), b=b[rows].contiguous(),
            dt_bias=layer.dt_bias,
        )
        if layer.allow_neg_eigval:
            beta = beta * 2.0
        y, _ = vllm_ops.chunk_gated_delta_rule_cpu(
            query=q, key=k, value=v, g=g, beta=beta, initial_state=ssm_state,
            output_final_state=True, cu_seqlens=loc, head_first=False,
            use_qk_l2norm_in_kernel=True, initial_state_indices=idx,
        )
        out[rows] = y.squeeze(0)
'''

OLMO_ON_CPU = '''
class OlmoHybridGatedDeltaNetOnCPU(OlmoHybridGatedDeltaNetAttention):
    """vLLM's OLMo Hybrid gated DeltaNet. vLLM 0.32 runs its core with Triton kernels
    only, which its CPU build lacks: there the core runs vLLM's CPU gated-delta-rule
    ops (`gated_delta_rule_on_cpu`); the projections, the gated norm and the state
    cache are vLLM's layer's as everywhere."""

    def __init__(self, config, vllm_config, prefix=""):
        if not current_platform.is_cpu():
            super().__init__(config, vllm_config, prefix=prefix)
            return
        from vllm.model_executor.layers.mamba.gdn import olmo_gdn_linear_attn as built

        # vLLM 0.32 hands Triton an allocator here on every platform; its CPU build has
        # no Triton to take it (`triton.set_allocator` is missing there)
        allocator = built.set_triton_allocator
        built.set_triton_allocator = lambda device: None
        try:
            super().__init__(config, vllm_config, prefix=prefix)
        finally:
            built.set_triton_allocator = allocator

    def _forward_core(self, mixed_qkv, b, a, core_attn_out):
        if not current_platform.is_cpu():
            return super()._forward_core(mixed_qkv, b, a, core_attn_out)
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if isinstance(meta, dict) else None
        if meta is None or meta.num_actual_tokens == 0:
            return  # the profile run: its values are not read
        conv_state = self.kv_cache[0]
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        slots, heads, v_dim, k_dim = self.kv_cache[1].shape
        gated_delta_rule_on_cpu(
            self,
            meta.num_decodes,
            meta.non_spec_state_indices_tensor,
            meta.non_spec_query_start_loc,
            meta.has_initial_state,
            conv_state,
            self.kv_cache[1].view(slots, heads, k_dim, v_dim),
            mixed_qkv,
            b,
            a,
            core_attn_out,
        )
'''


# a conv vLLM's loader takes one part at a time, by a shard id AutoWeightsLoader does not
# hand it
CONV_PARTS = """
    def _conv_parts(self, weights: Iterable[tuple[str, torch.Tensor]], loaded: set):
        # the gated DeltaNet's conv, held as parts (q, k, v) or whole: vLLM's loader for
        # it takes q, k and v one at a time by a shard id AutoWeightsLoader does not
        # hand it, so it loads here. The parts are joined first and split at q, k, v:
        # transformers saves the joined conv in equal thirds, not at q, k, v
        params = dict(self.named_parameters())
        parts = {parts}
        held: dict[str, dict[str, torch.Tensor]] = {{}}
        for name, tensor in weights:
            stem, _, leaf = name.rpartition(".")
            scope, _, conv = stem.rpartition(".")
            target = f"{{scope}}.conv1d.{{leaf}}"
            if not (name.endswith({ends}) and conv in ("conv1d", *parts)):
                yield name, tensor
                continue
            if target not in params:
                continue  # another pipeline stage's layer
            held.setdefault(target, {{}})[conv] = tensor
            got = held[target]
            if "conv1d" not in got and not all(p in got for p in parts):
                continue
            whole = got.get("conv1d")
            if whole is None:
                whole = torch.cat([got[p].reshape(-1, *got[p].shape[1:]) for p in parts])
            layer = self.get_submodule(scope)
            sizes = [layer.key_dim, layer.key_dim, layer.value_dim]
            param = params[target]
            for shard, piece in enumerate(whole.split(sizes)):
                param.weight_loader(param, piece, shard)
            loaded.add(target)
            del held[target]
"""
