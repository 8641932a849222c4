"""The Mamba-1 mixer's proof: the source module over a prefill and then single decode
steps with transformers' cache carrying its conv and SSM states, against what the
generated `MambaMixerOnCPU` computes at one rank on the same weights: vLLM's causal-conv
ops, its norms' arithmetic, the prefill scan (vLLM's kernel where the build has one, else
the emitted `selective_scan_by_steps`, run from the text the file will hold) and vLLM's
state-update op per decode step, the states carried in vLLM's layout.

`D` and the norms' weights, which the source initialises to ones, are drawn at random
first, so a dropped skip or a norm placed on the wrong tensor cannot hide behind them.
"""

from __future__ import annotations

import copy

from ..base import PatternRefused
from ..state_layers import (
    compared,
    evaluated,
    proven_with_flags,
    require_shapes,
    source_outputs,
)
from .emit import SCAN_BY_STEPS
from .match import NORMS, Mamba1Spec

STEPS = 8
TOLERANCE = 1e-4  # the scan sums in another order on each side


def prove(
    spec: Mamba1Spec, module, config, steps: int = STEPS, constants: dict | None = None
) -> None:
    """Proven on `config`, then with each boolean config field the mixer's `__init__`
    reads flipped (the mixer rebuilt with the `constants` its builders pass)."""
    proven_with_flags(
        lambda mod, cfg: _prove_one(spec, mod, cfg, steps),
        spec.info,
        module,
        config,
        constants,
    )


def norm_weights(spec: Mamba1Spec, module) -> bool:
    """The source's norms hold a weight the checkpoint has (Jamba), or none (Falcon-
    Mamba's weightless norm: a buffer of ones it never reads)."""
    if not spec.normed:
        return True
    held = {any(True for _ in getattr(module, a).parameters()) for a in NORMS}
    if len(held) > 1:
        raise PatternRefused("some of its norms hold a weight and some do not")
    return held.pop()


def _prove_one(spec: Mamba1Spec, module, config, steps: int) -> None:
    import torch

    args = evaluated(spec.args, config)
    _check_shapes(spec, module, args)
    module = _randomised(module, spec)
    prompt = args["conv_kernel_size"] + 6
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, prompt + steps, args["hidden_size"], generator=gen)
    compared(
        lambda: source_outputs(module, config, x, prompt),
        lambda: _vllm(module, spec, args, x[0], prompt),
        prompt,
        steps,
        TOLERANCE,
        ("the mixer", "states"),
    )


def _check_shapes(spec: Mamba1Spec, module, args: dict) -> None:
    inter, state = args["intermediate_size"], args["ssm_state_size"]
    rank, kernel = args["time_step_rank"], args["conv_kernel_size"]
    expect = {
        "A_log": (tuple(module.A_log.shape), (inter, state)),
        "D": (tuple(module.D.shape), (inter,)),
        "the in-projection's width": (module.in_proj.out_features, 2 * inter),
        "x_proj's width": (module.x_proj.out_features, rank + 2 * state),
        "dt_proj's input": (module.dt_proj.in_features, rank),
        "the conv's weight": (
            tuple(getattr(module, spec.conv).weight.shape),
            (inter, 1, kernel),
        ),
    }
    require_shapes(expect)


def _randomised(module, spec: Mamba1Spec):
    import torch

    module = copy.deepcopy(module).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        module.D.copy_(torch.randn(module.D.shape, generator=gen))
        module.A_log.copy_(
            module.A_log + torch.randn(module.A_log.shape, generator=gen) / 4
        )
        for attr in NORMS if spec.normed else ():
            for p in getattr(module, attr).parameters():
                p.copy_(1 + torch.randn(p.shape, generator=gen) / 4)
        for p in getattr(module, spec.conv).parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 2)
    return module


def _rms(x, weight, eps: float):
    """vLLM's RMSNorm (with or without a weight) on the last axis."""
    import torch

    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return out * weight if weight is not None else out


def _vllm(module, spec: Mamba1Spec, args: dict, x, prompt: int):
    """[tokens, hidden]: what MambaMixerOnCPU computes at one rank, the prefill over the
    prompt and one decode step per token, the states in vLLM's layout."""
    import torch
    import torch.nn.functional as F

    from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
        causal_conv1d_fn,
        causal_conv1d_update,
    )
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        space = {"torch": torch}
        exec(SCAN_BY_STEPS, space)  # noqa: S102 - the text the file holds
        scan = space["selective_scan_by_steps"]

        def step(h, dt, A, B, C, gate, dt_bias, ssm_state, slot):
            y = scan(
                h.transpose(0, 1), dt, A, B, C, module.D, gate.transpose(0, 1),
                dt_bias, ssm_state, torch.tensor([0, 1]), slot, None,
            )  # fmt: skip
            return y.transpose(0, 1)

    else:  # vLLM's MambaMixer.forward_impl, as the generated mixer runs it there
        from vllm.model_executor.layers.mamba.ops.mamba_ssm import selective_scan_fn
        from vllm.model_executor.layers.mamba.ops.ssu_dispatch import (
            selective_state_update,
        )

        def scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, starts, slots, initial):
            return selective_scan_fn(
                x, ssm_state, dt, A, B.transpose(-2, -1), C.transpose(-2, -1),
                D.float(), z, dt_bias, delta_softplus=True, cache_indices=slots,
                has_initial_state=initial, query_start_loc=starts,
            )  # fmt: skip

        def step(h, dt, A, B, C, gate, dt_bias, ssm_state, slot):
            y = torch.empty_like(h)
            selective_state_update(
                ssm_state, h, dt.transpose(0, 1), A, B, C, module.D, dt_bias,
                z=gate, dt_softplus=True, state_batch_indices=slot[:, None],
                dst_state_batch_indices=slot[:, None], out=y,
            )  # fmt: skip
            return y

    inter, state = args["intermediate_size"], args["ssm_state_size"]
    rank, kernel = args["time_step_rank"], args["conv_kernel_size"]
    conv = getattr(module, spec.conv)
    weights = conv.weight.view(inter, kernel)
    eps = float(args.get("rms_norm_eps", 0.0))
    weighted = norm_weights(spec, module)
    A = -torch.exp(module.A_log.float())
    dt_bias = module.dt_proj.bias.float()
    activation = args["activation"]
    conv_state = torch.zeros(2, inter, kernel - 1)
    ssm_state = torch.zeros(2, inter, state)
    slot = torch.tensor([1], dtype=torch.int32)

    def norm(attr, t):
        if not spec.normed:
            return t
        return _rms(t, getattr(module, attr).weight if weighted else None, eps)

    def ssm_transform(h):  # h: [tokens, inter] -> dt [inter, tokens], B, C
        dt, B, C = F.linear(h, module.x_proj.weight).split([rank, state, state], -1)
        dt, B, C = norm(NORMS[0], dt), norm(NORMS[1], B), norm(NORMS[2], C)
        return F.linear(dt, module.dt_proj.weight).transpose(-2, -1), B, C

    outs = []
    with torch.no_grad():
        h, gate = F.linear(
            x[:prompt], module.in_proj.weight, module.in_proj.bias
        ).chunk(2, dim=-1)
        h = causal_conv1d_fn(
            h.transpose(0, 1).contiguous(),
            weights,
            conv.bias,
            activation=activation,
            conv_states=conv_state,
            has_initial_state=torch.tensor([False]),
            cache_indices=slot,
            query_start_loc=torch.tensor([0, prompt], dtype=torch.int32),
            metadata=None,
        )
        dt, B, C = ssm_transform(h.transpose(0, 1))
        y = scan(
            h,
            dt,
            A,
            B,
            C,
            module.D,
            gate.transpose(0, 1).contiguous(),
            dt_bias,
            ssm_state,
            torch.tensor([0, prompt], dtype=torch.int32),
            slot,
            torch.tensor([False]),
        )
        outs.append(
            F.linear(y.transpose(0, 1), module.out_proj.weight, module.out_proj.bias)
        )
        for t in range(prompt, x.shape[0]):
            h, gate = F.linear(
                x[t : t + 1], module.in_proj.weight, module.in_proj.bias
            ).chunk(2, dim=-1)
            h = causal_conv1d_update(
                h.contiguous(),
                conv_state,
                weights,
                conv.bias,
                activation,
                conv_state_indices=slot,
            )
            dt, B, C = ssm_transform(h)
            y = step(h, dt, A, B, C, gate, dt_bias, ssm_state, slot)
            outs.append(F.linear(y, module.out_proj.weight, module.out_proj.bias))
    return torch.cat(outs, dim=0)
