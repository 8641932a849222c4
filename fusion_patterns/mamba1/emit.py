"""What the generated file holds for a proven Mamba-1 mixer: vLLM's `MambaMixer` built
from the source's own expressions (as `MambaMixerOnCPU`, which is vLLM's mixer wherever
vLLM has its kernels), and the state shape from the same expressions."""

from __future__ import annotations

import libcst as cst

from ..base import code
from ..moe.match import bind, resolve
from .match import Mamba1Spec

ORDER = (
    "hidden_size",
    "ssm_state_size",
    "conv_kernel_size",
    "intermediate_size",
    "time_step_rank",
    "use_conv_bias",
    "use_bias",
)
# MambaMixer's keyword -> MambaStateShapeCalculator.mamba1_state_shape's
SHAPE_ARGS = {
    "intermediate_size": "intermediate_size",
    "ssm_state_size": "state_size",
    "conv_kernel_size": "conv_kernel",
}


def construction(spec: Mamba1Spec, call: cst.Call, attr: str) -> str:
    bound = bind(spec.info, call)
    values = {k: code(resolve(spec.args[k], spec.info, bound)) for k in ORDER}
    values["use_rms_norm"] = str(spec.normed)
    if spec.normed:
        values["rms_norm_has_weight"] = str(spec.norm_weights)
        values["rms_norm_eps"] = code(
            resolve(spec.args["rms_norm_eps"], spec.info, bound)
        )
    values["activation"] = code(resolve(spec.args["activation"], spec.info, bound))
    args = [f"{k}={v}" for k, v in values.items()]
    args += [
        "model_config=get_current_vllm_config().model_config",
        "cache_config=get_current_vllm_config().cache_config",
        f'prefix=f"{{prefix}}.{attr}"',  # the state cache's key: the module's path
    ]
    return "MambaMixerOnCPU(" + ", ".join(args) + ")"


def state_shape(spec: Mamba1Spec) -> dict[str, str]:
    return {arg: code(spec.args[k]) for k, arg in SHAPE_ARGS.items()}


# vLLM 0.32's CPU build has no selective-scan kernel (`selective_scan_fwd`) for
# MambaMixer's prefill, and its CPU state-update backend takes Mamba-2's state layout
SCAN_BY_STEPS = '''
def selective_scan_by_steps(x, dt, A, B, C, D, z, dt_bias, ssm_state, starts, slots, has_initial):
    """vLLM's varlen `selective_scan_fn` in torch, one step per token (x, dt, z:
    [dim, tokens]; B, C: [tokens, state]; each sequence starting from its slot of
    `ssm_state` where `has_initial` says so (None: every one), its final state written
    back there): where vLLM's build has no kernel for it."""
    dt = dt.float() + dt_bias.float()[:, None] if dt_bias is not None else dt.float()
    dt = torch.nn.functional.softplus(dt)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    # a loop over the data, but inside vLLM's custom op (`torch.ops.vllm.mamba_mixer`),
    # which torch.compile's graph calls without tracing
    for i, slot in enumerate(slots):
        if has_initial is None or bool(has_initial[i]):
            h = ssm_state[slot].float()
        else:
            h = torch.zeros(A.shape, dtype=torch.float32, device=x.device)
        for t in range(int(starts[i]), int(starts[i + 1])):
            h = torch.exp(dt[:, t, None] * A) * h + (dt[:, t] * x[:, t].float())[
                :, None
            ] * B[t].float()
            y[:, t] = h @ C[t].float()
        ssm_state[slot] = h.to(ssm_state.dtype)
    y = y + D.float()[:, None] * x.float()
    return (y * torch.nn.functional.silu(z.float())).to(x.dtype)


'''


# vLLM's MambaMixer, with the scan above where vLLM's build has no kernel for it
CPU_MIXER = '''
class MambaMixerOnCPU(MambaMixer):
    """vLLM's MambaMixer. vLLM's CPU build has no selective-scan kernel for a prefill,
    and its CPU state-update kernel takes one decay per head (Mamba-2's), not Mamba-1's
    per channel and state: there, the scan and the decode steps run in torch
    (`selective_scan_by_steps`); the conv, the projections and the norms are vLLM's as
    everywhere."""

    def forward_impl(self, hidden_states: torch.Tensor, output: torch.Tensor):
        if not current_platform.is_cpu():
            return super().forward_impl(hidden_states, output)
        meta = get_forward_context().attn_metadata
        meta = meta.get(self.prefix) if meta is not None else None
        x, gate = self.in_proj(hidden_states)[0].transpose(-2, -1).chunk(2, dim=-2)
        if meta is None:  # the profile run: its values are not read
            output[: hidden_states.shape[0]] = self.out_proj(x.transpose(-2, -1).contiguous())[0]
            return
        conv_state = self.kv_cache[0]
        if not is_conv_state_dim_first():
            conv_state = conv_state.transpose(-1, -2)
        ssm_state = self.kv_cache[1]
        weights = self.conv1d.weight.view(
            self.conv1d.weight.size(0), self.conv1d.weight.size(2)
        )
        dt_bias = self._time_proj_bias()
        decodes, prefills = meta.num_decode_tokens, meta.num_prefill_tokens
        ys = []
        if decodes:  # decode tokens come first, one per request
            slots = meta.state_indices_tensor_d[:, 0]
            x_d = vllm_causal_conv1d_update(
                x[:, :decodes].transpose(0, 1).contiguous(),
                conv_state,
                weights,
                self.conv1d.bias,
                self.activation,
                conv_state_indices=slots,
            )
            dt, B, C = self._ssm_transform(x_d.contiguous())
            ys.append(
                selective_scan_by_steps(
                    x_d.transpose(0, 1),
                    dt,
                    self.A,
                    B,
                    C,
                    self.D,
                    gate[:, :decodes],
                    dt_bias,
                    ssm_state,
                    torch.arange(decodes + 1),
                    slots,
                    None,  # every decode step continues its request's state
                )
            )
        if prefills:
            x_p = vllm_causal_conv1d_fn(
                x[:, decodes : decodes + prefills].contiguous(),
                weights,
                self.conv1d.bias,
                activation=self.activation,
                conv_states=conv_state,
                has_initial_state=meta.has_initial_states_p,
                cache_indices=meta.state_indices_tensor_p,
                query_start_loc=meta.query_start_loc_p,
                metadata=meta,
            )
            # vLLM's CPU GEMM takes a contiguous input
            dt, B, C = self._ssm_transform(x_p.transpose(-2, -1).contiguous())
            ys.append(
                selective_scan_by_steps(
                    x_p,
                    dt,
                    self.A,
                    B,
                    C,
                    self.D,
                    gate[:, decodes : decodes + prefills],
                    dt_bias,
                    ssm_state,
                    meta.query_start_loc_p,
                    meta.state_indices_tensor_p,
                    meta.has_initial_states_p,
                )
            )
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        output[: decodes + prefills] = self.out_proj(y.transpose(-2, -1).contiguous())[0]
'''
