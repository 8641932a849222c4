"""The short convolution's proof: the source module over a prefill and then single
decode steps with transformers' cache carrying its conv state, against what vLLM's
`ShortConv` computes at one rank (its own causal-conv ops, the ones its forward calls on
this platform, `C * conv(B * x)` between its projections) on the same weights, the conv
state carried in vLLM's layout from step to step.

The prompt is longer than the kernel, so a kernel off by one or a state dropped between
steps changes what the decode steps see.
"""

from __future__ import annotations

import copy


from ..state_layers import (
    compared,
    evaluated,
    proven_with_flags,
    require_shapes,
    source_outputs,
)
from .match import ShortConvSpec

STEPS = 8
TOLERANCE = 1e-4  # the conv sums its taps in another order on each side


def sizes(spec: ShortConvSpec, config) -> dict:
    """ShortConv's `dim`, `conv_L_cache` and `conv_bias` evaluated on `config`."""
    return evaluated({k: getattr(spec, k) for k in ("dim", "kernel", "bias")}, config)


def prove(spec: ShortConvSpec, module, config, steps: int = STEPS) -> None:
    """Proven on `config`, then with each boolean config field the block's `__init__`
    reads flipped."""
    proven_with_flags(
        lambda mod, cfg: _prove_one(spec, mod, cfg, steps), spec.info, module, config
    )


def _prove_one(spec: ShortConvSpec, module, config, steps: int) -> None:
    import torch

    args = sizes(spec, config)
    _check_shapes(spec, module, args)
    module = _randomised(module, spec)
    prompt = args["kernel"] + 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, prompt + steps, args["dim"], generator=gen)
    compared(
        lambda: source_outputs(module, config, x, prompt),
        lambda: _vllm(module, spec, args, x[0], prompt),
        prompt,
        steps,
        TOLERANCE,
        ("the conv", "conv state"),
    )


def _check_shapes(spec: ShortConvSpec, module, args: dict) -> None:
    dim, kernel = args["dim"], args["kernel"]
    conv = getattr(module, spec.conv)
    expect = {
        "the in-projection's width": (
            getattr(module, spec.in_proj).out_features,
            3 * dim,
        ),
        "the in-projection's input": (getattr(module, spec.in_proj).in_features, dim),
        "the out-projection's input": (getattr(module, spec.out_proj).in_features, dim),
        "the out-projection's width": (
            getattr(module, spec.out_proj).out_features,
            dim,
        ),
        "the conv's weight": (tuple(conv.weight.shape), (dim, 1, kernel)),
    }
    require_shapes(expect)


def _randomised(module, spec: ShortConvSpec):
    import torch

    module = copy.deepcopy(module).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in getattr(module, spec.conv).parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / 2)
    return module


def _vllm(module, spec: ShortConvSpec, args: dict, x, prompt: int):
    """[tokens, hidden]: what ShortConv's forward computes at one rank, its prefill
    branch over the prompt and its decode branch per token."""
    import torch
    import torch.nn.functional as F

    from vllm.platforms import current_platform

    if current_platform.is_cpu():  # ShortConv.forward_native's ops
        from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (
            causal_conv1d_fn_cpu as conv_fn,
        )
        from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import (
            causal_conv1d_update_cpu as conv_update,
        )
    else:  # its forward_cuda's
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
            causal_conv1d_fn as conv_fn,
        )
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import (
            causal_conv1d_update as conv_update,
        )

    in_proj, conv, out_proj = (
        getattr(module, a) for a in (spec.in_proj, spec.conv, spec.out_proj)
    )
    dim, kernel = args["dim"], args["kernel"]
    weights = conv.weight.view(dim, kernel)
    # two state blocks, the request in block 1 (vLLM keeps block 0 as its null block)
    conv_state = torch.zeros(2, dim, kernel - 1)
    slot = torch.tensor([1], dtype=torch.int32)
    outs = []
    with torch.no_grad():
        B, C, h = F.linear(x[:prompt], in_proj.weight, in_proj.bias).chunk(3, dim=-1)
        y = conv_fn(
            (B * h).transpose(0, 1).contiguous(),
            weights,
            conv.bias,
            conv_states=conv_state,
            query_start_loc=torch.tensor([0, prompt], dtype=torch.int32),
            cache_indices=slot,
            has_initial_state=torch.tensor([False]),
            activation=None,
            metadata=None,
        ).transpose(0, 1)[:prompt]
        outs.append(F.linear(C * y, out_proj.weight, out_proj.bias))
        for t in range(prompt, x.shape[0]):
            B, C, h = F.linear(x[t : t + 1], in_proj.weight, in_proj.bias).chunk(
                3, dim=-1
            )
            y = conv_update(
                (B * h).contiguous(),
                conv_state,
                weights,
                conv.bias,
                activation=None,
                conv_state_indices=slot,
            )
            outs.append(F.linear(C * y, out_proj.weight, out_proj.bias))
    return torch.cat(outs, dim=0)
