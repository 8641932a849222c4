"""A subclass of `nn.Linear` that computes a linear -> vLLM's linear, as `nn.Linear` is.

Falcon builds every projection from `FalconLinear(nn.Linear)`, whose forward writes the
product out (`input @ self.weight.T`, then `+ self.bias` when it has one). Copied as a
class of its own, it kept Falcon whole on every rank and outside vLLM's quantization.
A candidate is a class of the model on `nn.Linear` with no `__init__` of its own (so
its parameters are exactly `weight` and `bias`) and a forward of one tensor. The proof
runs the tiny model's own instance, with its bias and without one, on random inputs of
two and three dimensions (and on what the tiny model handed it) against
`F.linear(x, weight, bias)`; within fp32 rounding, every construction of the class is
then built as the copy builds `nn.Linear` (column- or row-parallel where its class's
sharding is proven, replicated otherwise) and the class is not emitted. A subclass
computing something else (a block-diagonal grouped projection) is copied as it is and
said with its difference.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import libcst as cst

from .base import CONSTRUCTION, Claim, ClassInfo, Pattern, Refusal
from .base import LINEARS, construction_records, proven_classes, takes_one_argument

NAME = "linear subclass"
# |F.linear - source| <= RTOL * (|x| |w| summed + 1): fp32 rounding of one product
# written two ways (a matmul and an addmm accumulate in other orders)
RTOL = 1e-5


@dataclass(frozen=True)
class LinearSpec:
    class_name: str
    error: float  # the largest difference the proof measured, relative


def _candidate(info: ClassInfo, instance) -> bool:
    from torch import nn

    if not set(info.bases) & set(LINEARS) or info.init is not None:
        return False
    return isinstance(instance, nn.Linear) and takes_one_argument(info.forward)


def _inputs(model, instance) -> list:
    import torch

    gen = torch.Generator().manual_seed(0)
    width = instance.in_features
    xs = [torch.randn(7, width, generator=gen), torch.randn(2, 5, width, generator=gen)]
    call = model.call(instance)
    if call is not None and call[0] and isinstance(call[0][0], torch.Tensor):
        xs.append(call[0][0].detach().float())
    return xs


def _difference(module, xs) -> float:
    """The largest relative difference between `module(x)` and F.linear on its own
    weight and bias (inf where the shapes differ or the forward fails)."""
    import torch
    import torch.nn.functional as F

    worst = 0.0
    with torch.no_grad():
        for x in xs:
            want = F.linear(x, module.weight, module.bias)
            try:
                got = module(x.clone())
            except Exception:  # noqa: BLE001 - a forward F.linear's inputs break
                return float("inf")
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                return float("inf")
            scale = x.abs() @ module.weight.abs().T + 1
            err = ((got - want).abs() / scale).max().item()
            if err != err:
                return float("inf")
            worst = max(worst, err)
    return worst


def prove(model, info: ClassInfo, instance) -> LinearSpec | Refusal:
    import torch

    with_bias = copy.deepcopy(instance).float()
    if with_bias.bias is None:  # a bias to see it added, whatever the tiny model built
        with_bias.bias = torch.nn.Parameter(torch.randn(with_bias.out_features))
    without = copy.deepcopy(with_bias)
    without.bias = None
    xs = [x.float() for x in _inputs(model, instance)]
    err = max(_difference(with_bias, xs), _difference(without, xs))
    if err <= RTOL:
        return LinearSpec(info.name, err)
    return Refusal(
        NAME,
        info.name,
        "linear",
        "its forward does not compute F.linear(x, self.weight, self.bias) "
        f"(relative difference {err:.1e}): copied as the source writes it",
    )


class LinearSubclass(Pattern):
    """Each construction of an `nn.Linear` subclass proven to compute `F.linear` is
    built as `nn.Linear` is (a vLLM linear); the class is not emitted."""

    name = NAME
    builds_linear = True

    def claim(self, model):
        for n, result in proven_classes(model, NAME, "linear", _candidate, prove):
            if isinstance(result, Refusal):
                yield result
                continue
            exact = f"within {result.error:.0e}" if result.error else "exactly"
            records = construction_records(
                model,
                n,
                NAME,
                "a vLLM linear, as nn.Linear",
                f"its forward is F.linear, {exact}",
            )
            yield Claim(self, n, result, CONSTRUCTION, records=records)

    def construction(self, claim: Claim, call: cst.Call, path: str | None) -> str:
        # the copy builds it as it builds `nn.Linear` (`Pattern.builds_linear`); the
        # source's own layer, where one is kept, is `nn.Linear` with the same arguments
        linear = call.with_changes(func=cst.parse_expression("nn.Linear"))
        return cst.Module(body=[]).code_for_node(linear)
