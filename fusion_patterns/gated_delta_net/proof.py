"""The gated DeltaNet's proof: the source module in fp32, over a prefill and then single
decode steps with transformers' cache carrying its conv and recurrent states, against
what vLLM's `QwenGatedDeltaNetAttention` computes at one rank on the same weights: its
own layout code (`fix_query_key_value_ordering`, `rearrange_mixed_qkv`), the causal-conv,
gating and delta-rule ops its CPU forward calls, its gated norm, with the states carried
in vLLM's layout from step to step.

vLLM's CPU delta-rule kernels run in bfloat16 only, so its side runs in bf16. The
tolerance is measured, not guessed: the source run in bf16 against itself in fp32 gives
the noise floor bf16 brings, and vLLM's side must stay within `FLOOR_FACTOR` times it.
A wrong layout, a dropped gate or a state not carried is wrong by far more (O(1)).

The parameters the source initialises to constants (`dt_bias = 1`, the norm's ones)
are drawn at random first, so a misplaced bias or norm cannot hide behind them.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

from ..base import PatternRefused
from ..dataflow import round_weights
from ..state_layers import (
    evaluated,
    proven_with_flags,
    ran,
    require_shapes,
    source_outputs,
    step_parts,
)
from .emit import RULE_ON_CPU
from .match import GatedDeltaNetSpec

STEPS = 8
# vLLM's bf16 side may be this many times further from the fp32 source than the
# source's own bf16 run is (its kernels round in other places); a floor of at least
# MIN_FLOOR (relative) so an exact tiny case does not demand exactness
FLOOR_FACTOR = 4.0
MIN_FLOOR = 1e-3


def sizes(spec: GatedDeltaNetSpec, config) -> dict:
    """vLLM's config fields, evaluated on `config` from the source's expressions."""
    return evaluated(spec.fields, config)


def prove(spec: GatedDeltaNetSpec, module, config, steps: int = STEPS) -> None:
    """Proven on `config`, then with each boolean config field the class's `__init__`
    reads flipped."""
    proven_with_flags(
        lambda mod, cfg: _prove_one(spec, mod, cfg, steps), spec.info, module, config
    )


def _prove_one(spec: GatedDeltaNetSpec, module, config, steps: int) -> None:
    import torch

    from ..dataflow import rel_err

    args = sizes(spec, config)
    _check_shapes(spec, module, args)
    module = _randomised(module, spec)
    prompt = args["linear_conv_kernel_dim"] + 9
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, prompt + steps, args["hidden_size"], generator=gen)
    # the weights as vLLM loads them in bf16, computing in fp32: what both bf16 runs
    # are held to
    rounded = copy.deepcopy(module)
    round_weights(rounded, torch.bfloat16)
    vllm = _vllm if spec.on_qwen else _vllm_on_cpu_rule
    want, own, got = ran(
        lambda: source_outputs(rounded, config, x, prompt),
        lambda: source_outputs(
            copy.deepcopy(rounded).bfloat16(), config, x.bfloat16(), prompt
        ).float(),
        lambda: vllm(rounded, spec, args, x[0], prompt),
    )
    parts = step_parts(prompt, steps, ("the delta rule", "conv and recurrent states"))
    floor = max(MIN_FLOOR, *(rel_err(own[rows], want[rows]) for _, rows in parts))
    for where, rows in parts:
        err = rel_err(got[rows], want[rows])
        if not err <= FLOOR_FACTOR * floor:
            raise PatternRefused(
                f"{where}: vLLM's bf16 computation differs from the fp32 "
                f"source (max rel err {err:.1e} > {FLOOR_FACTOR:g}x {floor:.1e}, "
                "the source's own bf16 error)"
            )


def _check_shapes(spec: GatedDeltaNetSpec, module, args: dict) -> None:
    key = args["linear_key_head_dim"] * args["linear_num_key_heads"]
    value = args["linear_value_head_dim"] * args["linear_num_value_heads"]
    heads = args["linear_num_value_heads"]
    if spec.interleaved:
        widths = [2 * key + 2 * value, 2 * heads]
    elif spec.target.fixed_projections:  # q, k, v, g; b and a beside them
        widths = [key, key, value, value]
    else:
        widths = [2 * key + value, value, heads, heads]
    expect = {
        f"self.{p}'s width": (getattr(module, p).out_features, w)
        for p, w in zip(spec.in_projs, widths)
    }
    expect["self.conv1d's weight"] = (
        tuple(module.conv1d.weight.shape),
        (2 * key + value, 1, args["linear_conv_kernel_dim"]),
    )
    norm, out = _norm_and_out(spec)
    expect[f"self.{out}'s input"] = (getattr(module, out).in_features, value)
    expect[f"self.{norm}'s weight"] = (
        tuple(getattr(module, norm).weight.shape),
        (args["linear_value_head_dim"],),
    )
    require_shapes(expect)


def _norm_and_out(spec: GatedDeltaNetSpec) -> tuple[str, str]:
    """The gated norm's and the out-projection's names (the record's last two)."""
    return spec.target.record[-2], spec.target.record[-1]


def _randomised(module, spec: GatedDeltaNetSpec):
    import torch

    module = copy.deepcopy(module).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        module.dt_bias.copy_(torch.randn(module.dt_bias.shape, generator=gen))
        norm = getattr(module, _norm_and_out(spec)[0])
        norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=gen) / 4)
        module.A_log.copy_(torch.rand(module.A_log.shape, generator=gen).log())
    return module


def _one_rank(args: dict, **more) -> SimpleNamespace:
    """The attributes vLLM's GDN layers' own methods read, at one rank (and `more`)."""
    nk, nv = args["linear_num_key_heads"], args["linear_num_value_heads"]
    dk, dv = args["linear_key_head_dim"], args["linear_value_head_dim"]
    return SimpleNamespace(
        num_k_heads=nk,
        num_v_heads=nv,
        head_k_dim=dk,
        head_v_dim=dv,
        key_dim=nk * dk,
        value_dim=nv * dv,
        tp_size=1,
        **more,
    )


def _vllm(module, spec: GatedDeltaNetSpec, args: dict, x, prompt: int):
    """[tokens, hidden]: vLLM's layer at one rank, its CPU forward (bf16), the prefill
    branch over the prompt and the decode branch per token."""
    import torch
    import torch.nn.functional as F
    from einops import rearrange

    import vllm._custom_ops as ops
    from vllm.model_executor.layers.layernorm import RMSNormGated
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention as Layer,
    )
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (
        causal_conv1d_fn_cpu,
        causal_conv1d_update_cpu,
    )

    bf16 = torch.bfloat16
    nk, nv = args["linear_num_key_heads"], args["linear_num_value_heads"]
    dk, dv = args["linear_key_head_dim"], args["linear_value_head_dim"]
    kernel = args["linear_conv_kernel_dim"]
    layer = _one_rank(args)
    weights = [getattr(module, p).weight for p in spec.in_projs]
    if spec.interleaved:
        w_qkvz, w_ba = weights
    else:
        w_qkvz, w_ba = torch.cat(weights[:2]), torch.cat(weights[2:])
    w_qkvz, w_ba = w_qkvz.to(bf16), w_ba.to(bf16)
    conv_dim = 2 * nk * dk + nv * dv
    conv_w = module.conv1d.weight.view(conv_dim, kernel).to(bf16)
    conv_b = None if module.conv1d.bias is None else module.conv1d.bias.to(bf16)
    A_log = module.A_log.float()  # vLLM holds A_log in fp32
    dt_bias = module.dt_bias.to(bf16)
    activation = args["hidden_act"]

    def project(rows):
        mixed_qkvz, ba = F.linear(rows, w_qkvz), F.linear(rows, w_ba)
        if spec.interleaved:
            q, k, v, z, b, a = Layer.fix_query_key_value_ordering(layer, mixed_qkvz, ba)
            q, k, v = (rearrange(t, "l p d -> l (p d)") for t in (q, k, v))
            return torch.cat((q, k, v), dim=-1), z, b, a
        mixed_qkv, z = mixed_qkvz.split([conv_dim, nv * dv], dim=-1)
        b, a = ba.chunk(2, dim=-1)
        return mixed_qkv, z.reshape(z.size(0), -1, dv), b, a

    def finish(core, z):
        y = RMSNormGated.forward_static(
            core,
            z,
            module.norm.weight.to(bf16),
            args["rms_norm_eps"],
            bf16,
            norm_before_gate=True,
            activation="silu",
        )
        return F.linear(y.reshape(y.size(0), -1), module.out_proj.weight.to(bf16))

    # two state blocks, the request in block 1 (vLLM keeps block 0 as its null block)
    conv_state = torch.zeros(2, conv_dim, kernel - 1, dtype=bf16)
    ssm_state = torch.zeros(2, nv, dk, dv, dtype=torch.float32)
    slot = torch.tensor([1], dtype=torch.int32)
    outs = []
    with torch.no_grad():
        mixed_qkv, z, b, a = project(x[:prompt].to(bf16))
        mixed_qkv = causal_conv1d_fn_cpu(
            x=mixed_qkv.transpose(0, 1).contiguous(),
            weight=conv_w,
            bias=conv_b,
            conv_states=conv_state,
            query_start_loc=torch.tensor([0, prompt], dtype=torch.int32),
            cache_indices=slot,
            has_initial_state=torch.tensor([False]),
            activation=activation,
        ).transpose(0, 1)
        q, k, v = Layer.rearrange_mixed_qkv(layer, mixed_qkv.contiguous())
        g, beta = ops.fused_gdn_gating_cpu(
            A_log=A_log, a=a.contiguous(), b=b.contiguous(), dt_bias=dt_bias
        )
        core, _ = ops.chunk_gated_delta_rule_cpu(
            query=q,
            key=k,
            value=v,
            g=g,
            beta=beta,
            initial_state=ssm_state,
            output_final_state=True,
            cu_seqlens=torch.tensor([0, prompt], dtype=torch.int32),
            head_first=False,
            use_qk_l2norm_in_kernel=True,
            initial_state_indices=slot,
        )
        outs.append(finish(core.squeeze(0), z))
        for t in range(prompt, x.shape[0]):
            mixed_qkv, z, b, a = project(x[t : t + 1].to(bf16))
            mixed_qkv = causal_conv1d_update_cpu(
                x=mixed_qkv.contiguous(),
                conv_state=conv_state,
                weight=conv_w,
                bias=conv_b,
                activation=activation,
                conv_state_indices=slot,
            )
            q, k, v = Layer.rearrange_mixed_qkv(layer, mixed_qkv.contiguous())
            core = ops.fused_sigmoid_gating_delta_rule_update_cpu(
                A_log=A_log,
                dt_bias=dt_bias,
                q=q,
                k=k,
                v=v,
                a=a.contiguous(),
                b=b.contiguous(),
                initial_state_source=ssm_state,
                initial_state_indices=slot,
                cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
                use_qk_l2norm_in_kernel=True,
            )
            outs.append(finish(core.squeeze(1).reshape(1, nv, dv), z))
    return torch.cat(outs, dim=0).float()


# vLLM's RMSNormGated in OLMo Hybrid's layer: eps 1e-5 (FLA's), whatever the config says
OLMO_NORM_EPS = 1e-5


def _vllm_on_cpu_rule(module, spec: GatedDeltaNetSpec, args: dict, x, prompt: int):
    """[tokens, hidden]: OLMo Hybrid's vLLM layer at one rank on vLLM's CPU build: its
    merged q|k|v|g projection, b and a beside it, the core the file runs there (the
    text of `gated_delta_rule_on_cpu`, executed), its gated norm, its out-projection."""
    import torch
    import torch.nn.functional as F

    import vllm._custom_ops as vllm_ops
    from vllm.model_executor.layers.layernorm import RMSNormGated
    from vllm.model_executor.layers.mamba.gdn.olmo_gdn_linear_attn import (
        OlmoHybridGatedDeltaNetAttention as Layer,
    )
    from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (
        causal_conv1d_fn_cpu,
        causal_conv1d_update_cpu,
    )

    env = {
        "torch": torch,
        "vllm_ops": vllm_ops,
        "causal_conv1d_fn_cpu": causal_conv1d_fn_cpu,
        "causal_conv1d_update_cpu": causal_conv1d_update_cpu,
    }
    exec(RULE_ON_CPU, env)  # noqa: S102 - the file's own text
    rule = env["gated_delta_rule_on_cpu"]
    bf16 = torch.bfloat16
    nk, nv = args["linear_num_key_heads"], args["linear_num_value_heads"]
    dk, dv = args["linear_key_head_dim"], args["linear_value_head_dim"]
    kernel, conv_dim = args["linear_conv_kernel_dim"], 2 * nk * dk + nv * dv
    layer = _one_rank(
        args,
        conv1d=SimpleNamespace(weight=module.conv1d.weight.to(bf16), bias=None),
        activation=args["hidden_act"],
        A_log=module.A_log.to(bf16),  # vLLM's layer holds it in the model's dtype
        dt_bias=module.dt_bias.to(bf16),
        allow_neg_eigval=bool(args["linear_allow_neg_eigval"]),
    )
    layer.rearrange_mixed_qkv = lambda t: Layer.rearrange_mixed_qkv(layer, t)
    w_qkvg = torch.cat([getattr(module, p).weight for p in spec.in_projs]).to(bf16)
    w_b, w_a = module.b_proj.weight.to(bf16), module.a_proj.weight.to(bf16)
    norm, out = (getattr(module, n) for n in _norm_and_out(spec))
    conv_state = torch.zeros(2, conv_dim, kernel - 1, dtype=bf16)
    ssm_state = torch.zeros(2, nv, dk, dv, dtype=bf16)
    slot = torch.tensor([1], dtype=torch.int32)

    def step(rows, decodes: int):
        mixed, gate = F.linear(rows, w_qkvg).split([conv_dim, nv * dv], dim=-1)
        core = torch.zeros(rows.size(0), nv, dv, dtype=bf16)
        rule(
            layer,
            decodes,
            slot,
            torch.tensor([0, rows.size(0)], dtype=torch.int32),
            torch.tensor([bool(decodes)]),
            conv_state,
            ssm_state,
            mixed,
            F.linear(rows, w_b),
            F.linear(rows, w_a),
            core,
        )
        y = RMSNormGated.forward_static(
            core.reshape(-1, dv),
            gate.reshape(-1, dv),
            norm.weight.to(bf16),
            OLMO_NORM_EPS,
            bf16,
            norm_before_gate=True,
        )
        return F.linear(y.reshape(rows.size(0), -1), out.weight.to(bf16))

    with torch.no_grad():
        outs = [step(x[:prompt].to(bf16), 0)]
        outs += [step(x[t : t + 1].to(bf16), 1) for t in range(prompt, x.shape[0])]
    return torch.cat(outs, dim=0).float()
