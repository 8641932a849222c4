"""The transformers reference: greedy continuations and teacher-forced logprobs."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_with_logprobs(model, prompts: list[list[int]], max_tokens: int):
    """For each prompt: (generated ids, logprobs [len(prompt)+max_tokens-1, vocab]).

    Full forwards without a cache: slower, but nothing of transformers' cache code is
    trusted (`use_cache=False`: a model whose cache set-up fails on a config it otherwise
    runs, such as a layer type the config has no window for, still has a reference).
    Row i of the logprobs predicts token i+1 of prompt + generated."""
    out = []
    for prompt in prompts:
        ids = list(prompt)
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
        logits = model(torch.tensor([ids[:-1]]), use_cache=False).logits[0].float()
        out.append((ids[len(prompt) :], torch.log_softmax(logits, dim=-1)))
    return out
