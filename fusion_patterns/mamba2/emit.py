"""What the generated file will hold for a proven Mamba-2 mixer: vLLM's `MambaMixer2`
built from the source's own expressions, and the causal LM's state methods (the shapes,
dtypes and copy functions of vLLM's state cache) from the same expressions, so the
cache and the layer can never disagree."""

from __future__ import annotations

import libcst as cst

from ..base import code
from ..moe.match import bind, resolve
from .match import Mamba2Spec

# MambaMixer2's keyword -> MambaStateShapeCalculator.mamba2_state_shape's
SHAPE_ARGS = {
    "intermediate_size": "intermediate_size",
    "n_groups": "n_groups",
    "num_heads": "num_heads",
    "head_dim": "head_dim",
    "ssm_state_size": "state_size",
    "conv_kernel_size": "conv_kernel",
}
ORDER = (
    "hidden_size",
    "ssm_state_size",
    "conv_kernel_size",
    "intermediate_size",
    "use_conv_bias",
    "use_bias",
    "n_groups",
    "num_heads",
    "head_dim",
    "rms_norm_eps",
    "activation",
)


def construction(
    spec: Mamba2Spec, call: cst.Call | None = None, attr: str = "mixer"
) -> str:
    """`MambaMixer2(...)` built as `self.<attr>`, its arguments the source's expressions
    over `config`, or, given the source's construction `call`, over the caller's."""
    bound = bind(spec.info, call) if call is not None else {}
    values = {k: code(resolve(spec.args[k], spec.info, bound)) for k in ORDER}
    if not spec.norm_grouped:
        values["n_groups"] = f"one_group({values['n_groups']})"
    if spec.use_rms_norm is not None:
        values["use_rms_norm"] = code(resolve(spec.use_rms_norm, spec.info, bound))
    args = [f"{k}={v}" for k, v in values.items()]
    args += [
        "model_config=get_current_vllm_config().model_config",
        "cache_config=get_current_vllm_config().cache_config",
        "quant_config=quant_config",
        f'prefix=f"{{prefix}}.{attr}"',  # the state cache's key: the module's path
    ]
    mixer = "MambaMixer2"
    if spec.time_step_limit is not None:
        mixer = "MambaMixer2WithTimeStepLimit"
        limit = code(resolve(spec.time_step_limit, spec.info, bound))
        args.insert(len(values), f"time_step_limit={limit}")
    built = f"with_sharded_bias({mixer}(" + ", ".join(args) + "))"
    if not spec.unproven:
        return built
    config = code(resolve(cst.Name("config"), spec.info, bound))
    unproven = ", ".join(
        "{" + ", ".join(f"{k!r}: {v!r}" for k, v in flags) + "}"
        for flags in spec.unproven
    )
    return f"proven_for({config}, ({unproven},), {built})"


def folded_scales(spec: Mamba2Spec, scopes: list[str]) -> str:
    """The causal LM's loader step folding the source's scales on the in-projection
    (its input's, a config value; its output's, a vector over its rows) into the
    checkpoint's in-projection weight and bias, before vLLM's loader shards them."""
    if spec.in_scale is None and spec.out_scale_value is None:
        return ""
    weights = tuple(f".{s}.{spec.in_proj}.weight" for s in scopes)
    biases = tuple(f".{s}.{spec.in_proj}.bias" for s in scopes)
    in_scale = code(spec.in_scale) if spec.in_scale is not None else "1.0"
    out_scale = spec.out_scale_value or "1.0"
    return f"""
    def _mamba2_scales(self, weights: Iterable[tuple[str, torch.Tensor]]):
        # the source scales the in-projection's input and output (rows): folded
        # into its weight (and bias) before vLLM's loader shards them
        config = self.config
        rows = torch.as_tensor({out_scale}, dtype=torch.float32).reshape(-1)
        for name, tensor in weights:
            folded = name.endswith({weights!r}) or name.endswith({biases!r})
            if folded and not tensor.is_floating_point():
                raise ValueError(
                    f"{{name}} is stored as {{tensor.dtype}}: the source's scales on it "
                    "are folded into a floating-point weight only"
                )
            if name.endswith({weights!r}):
                scale = rows[:, None] * {in_scale}
                tensor = (tensor.float() * scale).to(tensor.dtype)
            elif name.endswith({biases!r}):
                tensor = (tensor.float() * rows).to(tensor.dtype)
            yield name, tensor
"""


def state_shape(spec: Mamba2Spec) -> dict[str, str]:
    """The state cache's shape arguments: the expressions the mixer is built with."""
    return {arg: code(spec.args[k]) for k, arg in SHAPE_ARGS.items()}


# the source clamps dt = softplus(dt + dt_bias) from below; vLLM's scan does not
TIME_STEP_LIMIT = '''
class MambaMixer2WithTimeStepLimit(MambaMixer2):
    """MambaMixer2 with the source's time-step limit: the source's forward (its chunked
    scan, over every token) clamps the time step softplus(dt + dt_bias) from below;
    vLLM's scan takes it unclamped. softplus rises, so raising the raw dt to
    softplus^-1(floor) - dt_bias is that clamp."""

    def __init__(self, *args, time_step_limit=(0.0, float("inf")), **kwargs):
        super().__init__(*args, **kwargs)
        floor, ceiling = time_step_limit
        if ceiling != float("inf") or floor < 0:
            raise ValueError(
                f"time_step_limit={tuple(time_step_limit)}: vLLM's MambaMixer2 scan "
                "has no upper limit on the time step"
            )
        self.dt_floor = math.log(math.expm1(floor)) if floor > 0 else None

    def conv_ssm_forward(self, projected_states: torch.Tensor, output: torch.Tensor):
        if self.dt_floor is not None:
            dt = projected_states[:, -self.tped_dt_size :]
            floor = self.dt_floor - self.dt_bias.to(dt.dtype)
            projected_states = torch.cat(
                [projected_states[:, : -self.tped_dt_size], torch.maximum(dt, floor)],
                dim=-1,
            )
        super().conv_ssm_forward(projected_states, output)
'''


# flag settings under which the proof found the source's mixer and vLLM's different
PROVEN_FOR = '''
def proven_for(config, unproven: tuple[dict, ...], mixer: MambaMixer2) -> MambaMixer2:
    """The mixer, on a config the codemod's proof covers: each entry of `unproven` is a
    setting of config flags under which the source's mixer computes something else
    than vLLM's MambaMixer2."""
    for flags in unproven:
        if all(getattr(config, k) == v for k, v in flags.items()):
            setting = ", ".join(f"{k}={v}" for k, v in flags.items())
            raise ValueError(
                f"{setting}: this model's Mamba-2 mixer computes something vLLM's "
                "MambaMixer2 does not (the codemod's proof found them different)"
            )
    return mixer
'''


# a source norm over the whole gated width: vLLM's norm is per group
ONE_GROUP = '''
def one_group(n_groups: int) -> int:
    """The source normalises the gated output over its whole width; vLLM's MambaMixer2
    normalises within each group, the same only with one group."""
    if n_groups != 1:
        raise ValueError(
            f"n_groups={n_groups}: this model's gated norm spans the whole width, which "
            "vLLM's MambaMixer2 computes only with n_groups=1"
        )
    return n_groups
'''


# vLLM's MambaMixer2 with fewer groups than ranks gives its in-projection weight a
# loader placing each rank's groups, not its bias (vLLM's own file fails to load one)
SHARDED_BIAS = '''
def with_sharded_bias(mixer: MambaMixer2) -> MambaMixer2:
    """With fewer groups than ranks, MambaMixer2 loads its in-projection weight with a
    loader that gives each rank the groups its heads read; the bias, laid out alike,
    gets the same loader (vLLM leaves it the plain column loader, which cannot)."""
    bias = mixer.in_proj.bias
    if bias is not None and not isinstance(mixer.in_proj, MergedColumnParallelLinear):
        bias.weight_loader = mixer.in_proj.weight.weight_loader
    return mixer
'''
