"""Verifying a file vLLM's CPU build runs only in a reduced precision (bfloat16: its
gated-DeltaNet kernels), against transformers in fp32 on the same checkpoint.

The checkpoint's weights are bf16 values (`tiny.build_checkpoint(rounded_to=...)`), so
the engine in bf16 and the reference in fp32 hold the very same weights and differ only
in how they round while computing. How much that rounding may move a logprob is
measured, not guessed: transformers' own model in bf16 against itself in fp32 along the
same greedy path gives the noise floor (the largest and the mean difference), and the
engine must stay within `FLOOR_FACTOR` times both (its kernels round in other places
than transformers' bf16 does: measured up to 1.1x on Qwen3.5's tiny model). The mean
keeps a systematic error from hiding under one ill-conditioned position's max. Greedy
tokens must be equal, or split only where the fp32 reference is at a near tie: the
token the engine picked lies within the tolerance of the reference's pick. A wrong part
(a dropped gate, a state not carried) moves logprobs by far more than bf16 does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

FLOOR_FACTOR = 2.0


@dataclass(frozen=True)
class Floor:
    """transformers' own error in the reduced dtype, along the fp32 greedy path."""

    max: float
    mean: float

    @property
    def tolerance(self) -> float:
        return FLOOR_FACTOR * self.max


class _Run:
    """A transformers run in the shape `verify.compare` reads an engine's."""

    def __init__(self, prompts, greedy):
        self.tokens = [ids for ids, _ in greedy]
        self.logprobs = []
        for prompt, (ids, lp) in zip(prompts, greedy):
            seq = prompt + ids
            self.logprobs.append([float(lp[i - 1, seq[i]]) for i in range(1, len(seq))])


def noise_floor(model, dtype, prompts, ref, max_tokens, path_diffs) -> Floor:
    """|logprob differences| of transformers' model run in `dtype` from its fp32 run
    `ref`, along the path both follow."""
    import torch

    from . import reference

    low = copy.deepcopy(model).to(getattr(torch, dtype))
    own = reference.greedy_with_logprobs(low, prompts, max_tokens)
    diffs, _ = path_diffs(prompts, ref, _Run(prompts, own))
    return Floor(max(diffs), sum(diffs) / len(diffs))


def tie_gaps(prompts, ref, ran) -> list[float]:
    """For each prompt whose greedy tokens differ, at the first step they differ: how far
    below the reference's own pick the engine's pick lies in the reference's logprobs.
    """
    gaps = []
    for prompt, (ref_tokens, ref_lp), tokens in zip(prompts, ref, ran.tokens):
        step = next(
            (i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), None
        )
        if step is not None:
            row = ref_lp[len(prompt) - 1 + step]
            gaps.append(float(row[ref_tokens[step]] - row[tokens[step]]))
    return gaps


def holds(floor: Floor, diffs: list[float], gaps: list[float]) -> bool:
    """The engine's differences within FLOOR_FACTOR x the floor's max and mean, and its
    greedy tokens split from the reference's only at near ties."""
    return (
        bool(diffs)
        and max(diffs) <= floor.tolerance
        and sum(diffs) / len(diffs) <= FLOOR_FACTOR * floor.mean
        and all(g <= floor.tolerance for g in gaps)
    )
