"""The Mamba-2 mixer's proof: the source module, over a prefill and then single decode
steps with transformers' cache carrying its conv and SSM states, against the
computation vLLM's `MambaMixer2` runs at one rank (vLLM's own causal-conv, chunked-scan
and state-update ops, its gated norm over `n_groups` groups) on the same weights, with
its state tensors carried the way its state cache carries them.

The parameters the source initialises to constants (`D = 1`, `dt_bias = 1`, the norm's
ones) are drawn at random first, so a dropped `D` skip, a per-head mix-up or a norm
placed before the gate cannot hide behind them. The prompt is longer than the conv
kernel and than one SSD chunk.
"""

from __future__ import annotations

import copy
import math

from ..base import PatternRefused, code
from ..state_layers import (
    compared,
    config_flags,
    evaluated,
    flipped,
    rebuilt,
    require_shapes,
    source_outputs,
)
from .match import Mamba2Spec

STEPS = 8
TOLERANCE = 1e-4  # the scan sums in a different order on each side


def sizes(spec: Mamba2Spec, config) -> dict:
    """The MambaMixer2 arguments evaluated on `config`."""
    exprs = {**spec.args}
    for k in ("use_rms_norm", "in_scale"):
        if getattr(spec, k) is not None:
            exprs[k] = getattr(spec, k)
    out = evaluated(exprs, config)
    out.setdefault("use_rms_norm", True)
    out.setdefault("in_scale", 1.0)
    return out


def prove(spec: Mamba2Spec, module, config, steps: int = STEPS) -> tuple:
    """Proven on `config`; then each boolean config field the mixer's `__init__` reads
    is flipped, the mixer rebuilt and proven again. Returns the flag settings found to
    differ (each a tuple of (field, value)), which the generated file refuses to build.
    """
    _prove_one(spec, module, config, steps)
    return _unproven_flags(spec, module, config, steps)


def _prove_one(spec: Mamba2Spec, module, config, steps: int) -> None:
    import torch

    args = sizes(spec, config)
    env = {"config": config}
    chunk = (
        int(eval(code(spec.chunk_size), env)) if spec.chunk_size else 256
    )  # noqa: S307
    limit = (
        tuple(eval(code(spec.time_step_limit), env))  # noqa: S307
        if spec.time_step_limit is not None
        else (0.0, float("inf"))
    )
    if limit[1] != float("inf") or limit[0] < 0:
        raise PatternRefused(
            f"its time-step limit {limit} clamps dt from above, which vLLM's "
            "MambaMixer2 cannot"
        )
    args["time_step_floor"] = float(limit[0])
    _check_shapes(spec, module, args)
    module = _randomised(module, spec)
    prompt = max(chunk + 3, args["conv_kernel_size"] + 2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, prompt + steps, args["hidden_size"], generator=gen)
    if args["use_rms_norm"]:
        _prove_norm(spec, module, args)

    def source():
        if args["time_step_floor"] > 0:
            # the source's state update omits the floor its chunked scan applies: the
            # model's function is its forward over every token (what verify's reference
            # and transformers' scoring compute), so each step is held to that
            with torch.no_grad():
                return module(x)[0]
        return source_outputs(module, config, x, prompt)

    compared(
        source,
        lambda: _vllm(module, spec, args, chunk, x[0], prompt),
        prompt,
        steps,
        TOLERANCE,
        ("the mixer", "states"),
    )


def _holds(spec: Mamba2Spec, module, config, steps: int) -> bool:
    try:
        _prove_one(spec, rebuilt(module, config), config, steps)
    except PatternRefused:
        return False
    return True


def _unproven_flags(spec: Mamba2Spec, module, config, steps: int) -> tuple:
    """Each flag whose other value the proof refuses, with the other flags' values under
    which it does (a flag that only matters beside another: the norm's order, where the
    norm is built at all)."""
    flags = config_flags(spec.info, config)
    holds = {f: _holds(spec, module, flipped(config, f), steps) for f in flags}
    out = []
    for f in flags:
        if holds[f]:
            continue
        rescued = [
            g
            for g in flags
            if g != f and _holds(spec, module, flipped(config, f, g), steps)
        ]
        combo = {f: not getattr(config, f)}
        combo.update({g: getattr(config, g) for g in rescued})
        out.append(tuple(sorted(combo.items())))
    return tuple(out)


def _check_shapes(spec: Mamba2Spec, module, args: dict) -> None:
    heads, state = args["num_heads"], args["ssm_state_size"]
    groups, inter = args["n_groups"], args["intermediate_size"]
    conv_dim = inter + 2 * groups * state
    in_proj = getattr(module, spec.in_proj)
    expect = {
        "A_log": (module.A_log.numel(), heads),
        "the in-projection's width": (
            in_proj.out_features,
            inter + conv_dim + heads,
        ),
        "the conv's channels": (getattr(module, spec.conv).weight.shape[0], conv_dim),
        "heads x head_dim": (heads * args["head_dim"], inter),
    }
    require_shapes(expect)


def _gated_norm(weight, y, gate, groups: int, eps: float):
    """vLLM's `Mixer2RMSNormGated` at one rank: gate by silu, then an RMS norm within
    each of `groups` equal groups of the width."""
    import torch
    import torch.nn.functional as F

    y = y * F.silu(gate.float())
    grouped = y.view(*y.shape[:-1], groups, y.shape[-1] // groups)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * grouped.view(y.shape)


def _prove_norm(spec: Mamba2Spec, module, args: dict) -> None:
    """The source's gated norm is vLLM's: the gate before the norm, over `n_groups`
    groups (a norm over the whole width equals it only with one group)."""
    import torch

    from ..dataflow import rel_err

    norm = getattr(module, spec.norm)
    gen = torch.Generator().manual_seed(3)
    y, gate = torch.randn(2, 4, args["intermediate_size"], generator=gen)
    with torch.no_grad():
        want = norm(y, gate)
        got = _gated_norm(
            norm.weight, y, gate, args["n_groups"], float(args["rms_norm_eps"])
        )
    if not rel_err(got, want) <= TOLERANCE:
        raise PatternRefused(
            f"its gated norm (self.{spec.norm}) is not vLLM's Mixer2RMSNormGated: "
            f"vLLM gates by silu and then normalises within each of n_groups="
            f"{args['n_groups']} groups (a norm over the whole width, or with the gate "
            "applied after it, differs)"
        )


def _randomised(module, spec: Mamba2Spec):
    import torch

    module = copy.deepcopy(module).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in ("A_log", "dt_bias", "D"):
            p = getattr(module, name)
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
        # every other head's time step far below any floor (softplus(-8) = 3e-4), so a
        # floor on dt is reached, and one applied where the source does not, seen
        module.dt_bias[1::2] -= 8.0
        norm = getattr(module, spec.norm)
        for p in norm.parameters():
            p.copy_(1 + torch.randn(p.shape, generator=gen) / 4)
        conv = getattr(module, spec.conv)
        for p in conv.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 2)
    return module


def _vllm(module, spec: Mamba2Spec, args: dict, chunk: int, x, prompt: int):
    """[tokens, hidden]: what MambaMixer2.forward computes at one rank, its prefill
    branch over the prompt and its decode branch per token, states in vLLM's layout."""
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
        causal_conv1d_fn,
        causal_conv1d_update,
    )
    from vllm.model_executor.layers.mamba.ops.ssd_combined import (
        mamba_chunk_scan_combined_varlen,
    )
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mamba2_attn import compute_varlen_chunk_metadata

    inter, heads, dim = args["intermediate_size"], args["num_heads"], args["head_dim"]
    groups, state, kernel = (
        args["n_groups"],
        args["ssm_state_size"],
        args["conv_kernel_size"],
    )
    conv_dim = inter + 2 * groups * state
    in_proj, conv, out_proj = (
        getattr(module, a) for a in (spec.in_proj, spec.conv, spec.out_proj)
    )
    norm_weight = getattr(getattr(module, spec.norm), "weight", None)
    eps = float(args["rms_norm_eps"])
    weights = conv.weight.view(conv.weight.size(0), conv.weight.size(2))
    A = -torch.exp(module.A_log.float())
    activation = args["activation"]
    # two state blocks, the request in block 1: vLLM keeps block 0 as its null block,
    # which its kernels skip
    conv_state = torch.zeros(2, conv_dim, kernel - 1)
    ssm_state = torch.zeros(2, heads, dim, state)
    slot = torch.tensor([1], dtype=torch.int32)
    # the state-update kernel vLLM's dispatcher picks on this platform
    if current_platform.is_cpu():
        from vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm import (
            selective_state_update,
        )
    else:
        from vllm.model_executor.layers.mamba.ops.mamba_ssm import (
            selective_state_update,
        )

    def gated_norm(y, gate):
        if not args["use_rms_norm"]:  # MambaMixer2(use_rms_norm=False): the gate alone
            return y * F.silu(gate)
        return _gated_norm(norm_weight, y, gate, groups, eps)

    # the scales on the in-projection, folded into its weight as the loader folds them
    out_scale = (
        getattr(module, spec.out_scale).float().reshape(-1)
        if spec.out_scale is not None
        else torch.ones(in_proj.out_features)
    )
    weight = in_proj.weight * (out_scale[:, None] * args["in_scale"])
    bias = in_proj.bias * out_scale if in_proj.bias is not None else None

    def split(tokens):
        projected = F.linear(tokens, weight, bias)
        gate, xbc, dt = projected.split([inter, conv_dim, heads], dim=-1)
        if args["time_step_floor"] > 0:  # as the generated mixer clamps
            floor = math.log(math.expm1(args["time_step_floor"]))
            dt = torch.maximum(dt, floor - module.dt_bias)
        return gate, xbc, dt

    outs = []
    with torch.no_grad():
        gate, xbc, dt = split(x[:prompt])
        starts = torch.tensor([0, prompt], dtype=torch.int32)
        xbc = causal_conv1d_fn(
            xbc.transpose(0, 1),
            weights,
            conv.bias,
            activation=activation,
            conv_states=conv_state,
            has_initial_state=torch.tensor([False]),
            cache_indices=slot,
            metadata=None,
            query_start_loc=starts,
        ).transpose(0, 1)[:prompt]
        h, B, C = xbc.split([inter, groups * state, groups * state], dim=-1)
        cu_chunks, last_chunks, seq_idx = compute_varlen_chunk_metadata(starts, chunk)
        y = torch.empty(prompt, heads * dim)
        final = mamba_chunk_scan_combined_varlen(
            h.reshape(prompt, heads, dim),
            dt,
            A,
            B.reshape(prompt, groups, state),
            C.reshape(prompt, groups, state),
            chunk_size=chunk,
            D=module.D,
            z=None,
            dt_bias=module.dt_bias,
            seq_idx=seq_idx,
            cu_seqlens=starts,
            cu_chunk_seqlens=cu_chunks,
            last_chunk_indices=last_chunks,
            initial_states=None,
            dt_softplus=True,
            dt_limit=(0.0, float("inf")),
            out=y.view(prompt, heads, dim),
            state_dtype=torch.float32,
        )
        ssm_state[slot] = final
        outs.append(F.linear(gated_norm(y, gate), out_proj.weight, out_proj.bias))
        for t in range(prompt, x.shape[0]):
            gate, xbc, dt = split(x[t : t + 1])
            xbc = causal_conv1d_update(
                xbc,
                conv_state,
                weights,
                conv.bias,
                activation,
                conv_state_indices=slot[:, None],
                query_start_loc=None,
            )
            h, B, C = xbc.split([inter, groups * state, groups * state], dim=-1)
            y = torch.empty(1, heads, dim)
            selective_state_update(
                ssm_state,
                h.view(1, heads, dim),
                dt[:, :, None].expand(-1, -1, dim),
                A[:, None, None].expand(-1, dim, state),
                B.view(1, groups, state),
                C.view(1, groups, state),
                D=module.D[:, None].expand(-1, dim),
                dt_bias=module.dt_bias[:, None].expand(-1, dim),
                dt_softplus=True,
                state_batch_indices=slot,
                dst_state_batch_indices=slot,
                out=y,
            )
            y = y.view(1, heads * dim)
            outs.append(F.linear(gated_norm(y, gate), out_proj.weight, out_proj.bias))
    return torch.cat(outs, dim=0)
