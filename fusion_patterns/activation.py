"""A module class that computes an activation -> vLLM's activation op.

BLOOM's `BloomGelu` runs the tanh approximation of GELU as a custom autograd function of
six element-wise ops, each a pass over the MLP's widest tensor; vLLM's
`get_act_fn("gelu_pytorch_tanh")` is one kernel. A candidate is a class of the model
that holds no parameters, buffers or submodules and whose forward takes one tensor.
The proof runs the tiny model's own instance on random inputs over a wide range (and on
what the tiny model handed it) against each of vLLM's activations, one-kernel ones
first, and keeps the first that agrees within fp32 rounding: GELU's erf form and its
tanh approximation differ by 5e-4, never within it, so the file keeps exactly the form
the source computes. Every construction `BloomGelu()` then becomes `get_act_fn(<name>)`
and the class is not emitted; a candidate no activation matches is copied as it is and
said with the closest one.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from .base import CONSTRUCTION, Claim, ClassInfo, Pattern, Refusal
from .base import construction_records, proven_classes, takes_one_argument

NAME = "activation"
# vLLM's activation names (`get_act_fn`), those one kernel on every platform first
CANDIDATES = (
    "gelu",
    "gelu_pytorch_tanh",
    "silu",
    "relu",
    "tanh",
    "sigmoid",
    "quick_gelu",
    "relu2",
    "gelu_new",
    "gelu_fast",
)
# |vLLM - source| <= RTOL * (|source| + |x| + 1): fp32 rounding of one formula written
# two ways (measured: 1e-7 for BLOOM's form against torch's tanh GELU; erf/tanh 1e-4)
RTOL = 1e-6
SCALES = (0.5, 3.0, 12.0)


@dataclass(frozen=True)
class ActivationSpec:
    class_name: str
    vllm_name: str
    error: float  # the largest difference the proof measured, relative


def _candidate(info: ClassInfo, instance) -> bool:
    """No state, and a forward of one tensor: `forward(self, x)`."""
    if info.forward is None or instance is None:
        return False
    if any(True for _ in instance.parameters()) or any(
        True for _ in instance.buffers()
    ):
        return False
    if any(True for _ in instance.children()):
        return False
    return takes_one_argument(info.forward)


def _elementwise(instance, x) -> bool:
    """Each output element depends on its own input element only (a parameter-free
    LayerNorm, which normalises over a row, does not), on a flat tensor too."""
    import torch

    with torch.no_grad():
        try:
            flat = x.reshape(-1)[:64].clone()
            base = instance(flat.clone())
            bumped = flat.clone()
            bumped[0] += 1.0
            moved = instance(bumped)
        except Exception:  # noqa: BLE001 - a forward that needs its shape: not one
            return False
    if not isinstance(base, torch.Tensor) or base.shape != flat.shape:
        return False
    return torch.equal(base[1:], moved[1:])


def random_inputs() -> list:
    """The inputs every activation proof runs on: random at three scales, and -30..30."""
    import torch

    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(4096, generator=gen) * s for s in SCALES]
    xs.append(torch.linspace(-30.0, 30.0, 4001))
    return xs


def _inputs(model, instance):
    import torch

    xs = random_inputs()
    call = model.call(instance)
    if call is not None and call[0] and isinstance(call[0][0], torch.Tensor):
        xs.append(call[0][0].detach().float())
    return xs


def difference(instance, vllm_op, xs) -> float:
    import torch

    worst = 0.0
    with torch.no_grad():
        for x in xs:
            want = instance(x.clone()).float()
            got = vllm_op(x.clone()).float()
            if got.shape != want.shape:
                return float("inf")
            # rounding grows with the input where `1 + erf(x)` cancels: scaled by both
            err = ((got - want).abs() / (want.abs() + x.abs() + 1)).max().item()
            if err != err:  # NaN where one side is not
                return float("inf")
            worst = max(worst, err)
    return worst


def prove(model, info: ClassInfo, instance) -> ActivationSpec | Refusal | None:
    """vLLM's activation `instance` computes, or why none; None when it is not
    element-wise (not an activation at all)."""
    import vllm._custom_ops  # noqa: F401 - registers the kernels vLLM's ops call
    from vllm.model_executor.layers.activation import get_act_fn

    xs = _inputs(model, instance)
    if not _elementwise(instance, xs[-1]):
        return None
    closest = (float("inf"), "")
    for name in CANDIDATES:
        err = difference(instance, get_act_fn(name), xs)
        if err <= RTOL:
            return ActivationSpec(info.name, name, err)
        closest = min(closest, (err, name))
    return Refusal(
        NAME,
        info.name,
        "activation",
        f"computes none of vLLM's activations (closest: get_act_fn({closest[1]!r}), "
        f"relative difference {closest[0]:.1e})",
    )


class Activation(Pattern):
    """Each construction of a stateless one-tensor module class that computes one of
    vLLM's activations becomes that op; the class is not emitted."""

    name = NAME

    def claim(self, model):
        skip = model.roles.attention
        found = proven_classes(model, NAME, "activation", _candidate, prove, skip)
        for n, result in found:
            if isinstance(result, Refusal):
                yield result
                continue
            records = construction_records(
                model,
                n,
                NAME,
                f'get_act_fn("{result.vllm_name}")',
                f"within {result.error:.0e} of the source",
            )
            yield Claim(self, n, result, CONSTRUCTION, records=records)

    def construction(self, claim: Claim, call: cst.Call, path: str | None) -> str:
        return f'get_act_fn("{claim.spec.vllm_name}")'
