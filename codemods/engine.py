"""Run a checkpoint in real vLLM and report which class ran, tokens and logprobs."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class EngineResult:
    impl: str  # "module:qualname" of the model class that actually ran
    tokens: list[list[int]]
    # per prompt: logprob of each actual next token, prompt positions 1.. then generated
    logprobs: list[list[float]]
    # what vLLM logged about fusions while building the model (Transformers backend)
    fused: list[str] = None
    # per rank: bytes of its parameters outside the embeddings and the head
    rank_bytes: list[int] = None


def model_class_name(model) -> str:
    """Module-level, so vLLM can ship it to worker processes."""
    cls = type(model)
    return f"{cls.__module__}:{cls.__qualname__}"


# vLLM's MLA layer re-lays its kv_b_proj's weight after loading as these parameters
# (per rank, as kv_b_proj is): a second copy of a checkpoint tensor, not more of the model
MLA_DERIVED = ("W_UV", "W_UK_T")


def body_bytes(model, without: tuple[str, ...] = ()) -> int:
    """Bytes of this rank's parameters outside the embeddings and the head: what tensor
    parallelism is meant to divide (`without`: prefixes of modules a generated file does
    not build, a tower its text model never runs). Module-level, so vLLM can ship it to
    workers."""
    from torch import nn
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )

    head = getattr(model, "get_output_embeddings", lambda: None)()  # transformers'
    skip = {
        id(p)
        for mod in model.modules()
        if isinstance(mod, (VocabParallelEmbedding, nn.Embedding)) or mod is head
        for p in mod.parameters()
    }
    skip |= {
        id(p)
        for path, mod in model.named_modules()
        if any((path + ".").startswith(prefix) for prefix in without)
        for p in mod.parameters()
    }
    total = 0
    for mod in model.modules():
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in skip:
                continue
            if isinstance(mod, MLAAttention) and name in MLA_DERIVED:
                continue
            skip.add(id(p))  # a tied parameter (Zamba 2's shared blocks) counts once
            count = p.numel()
            if not count and name == "weight" and hasattr(mod, "input_size"):
                # vLLM's CPU build repacks a linear's weight out of the parameter:
                # what this rank holds is its partition's shape
                rows = (
                    getattr(mod, "output_size_per_partition", None) or mod.output_size
                )
                cols = getattr(mod, "input_size_per_partition", None) or mod.input_size
                count = rows * cols
            total += count * p.element_size()
    return total


def set_cpu_env(tp: int, pp: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # fp32 on every CPU: with AMX tiles vLLM 0.32 runs some fp32 layers through kernels
    # that take bf16/fp16 weights only (generated.NO_AMX); CODEMODS_NO_AMX=0 keeps them
    os.environ.setdefault("CODEMODS_NO_AMX", "1")
    if tp * pp == 1:
        # engine and worker in this process: fast start, several engines per process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # for apply_model
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp * pp))
        )
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def start_llm(
    model_dir: str,
    arch: str,
    tp: int = 1,
    pp: int = 1,
    dtype: str = "float32",
    **extra,
):
    """vLLM's `LLM` as every run here starts it: fp32 (unless a file says its CPU
    kernels take only `dtype`), no tokenizer, `arch` forced."""
    set_cpu_env(tp, pp)
    from vllm import LLM

    if pp > 1:
        # PP=2 with enforce_eager crashes in 0.32 on CPU (the warm-up that allocates the
        # intermediate-tensor buffer is skipped); compile mode with the eager backend works.
        kwargs = {
            "enforce_eager": False,
            "compilation_config": {"mode": 2, "backend": "eager"},
        }
    else:
        kwargs = {"enforce_eager": True}
    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=256,
        seed=0,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        hf_overrides={"architectures": [arch]},
        **kwargs,
        **extra,
    )


def prompt_logits(
    model_dir: str, arch: str, prompts: list[list[int]]
) -> tuple[str, list]:
    """(class that ran, raw logits [len(prompt) - 1, vocab] per prompt): every vocabulary
    entry at every prompt position, from one real engine forward per prompt."""
    import torch
    from vllm import SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = start_llm(model_dir, arch, 1, 1, max_logprobs=-1, logprobs_mode="raw_logits")
    try:
        impl = llm.apply_model(model_class_name)[0]
        params = SamplingParams(
            temperature=0, max_tokens=1, prompt_logprobs=-1, detokenize=False
        )
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        logits = []
        for out in outs:
            rows = out.prompt_logprobs[1:]
            vocab = len(rows[0])
            logits.append(
                torch.tensor([[row[t].logprob for t in range(vocab)] for row in rows])
            )
    finally:
        del llm
        cleanup_dist_env_and_memory()
    return impl, logits


class _FusedLines:
    """Collects the `Fused: ...` lines vLLM's Transformers backend logs."""

    def __enter__(self):
        import logging

        self.lines: list[str] = []
        collector = self

        class Handler(logging.Handler):
            def emit(self, record):
                text = record.getMessage()
                if text.startswith(("Fused: ", "Found: ")) or "left unfused" in text:
                    collector.lines.append(text)

        self.handler = Handler()
        self.logger = logging.getLogger("vllm")
        self.logger.addHandler(self.handler)
        # `apply` in the same process (coverage, the tests) quiets vLLM to errors, which
        # would drop these INFO lines before any handler saw them
        self.level = self.logger.level
        if not self.logger.isEnabledFor(logging.INFO):
            self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        return False


def greedy(
    llm, prompts: list[list[int]], max_tokens: int, prompt_logprobs=True, lora=None
) -> tuple[list[list[int]], list[list[float]]]:
    """(greedy tokens, logprob of each followed token) per prompt: prompt positions 1..
    then the generated ones, or only the generated ones without `prompt_logprobs`."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        logprobs=1,
        prompt_logprobs=1 if prompt_logprobs else None,
        detokenize=False,
        ignore_eos=True,
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        lora_request=lora,
    )
    tokens, logprobs = [], []
    for prompt, out in zip(prompts, outs):
        gen = list(out.outputs[0].token_ids)
        seq = prompt + gen
        row = (
            [out.prompt_logprobs[i][seq[i]].logprob for i in range(1, len(prompt))]
            if prompt_logprobs
            else []
        )
        row += [lp[tok].logprob for tok, lp in zip(gen, out.outputs[0].logprobs)]
        tokens.append(gen)
        logprobs.append(row)
    return tokens, logprobs


def run(
    model_dir: str,
    arch: str,
    prompts: list[list[int]],
    max_tokens: int,
    tp: int = 1,
    pp: int = 1,
    expert_parallel: bool = False,
    model_impl: str | None = None,
    block_size: int | None = None,
    dtype: str = "float32",
) -> EngineResult:
    from vllm.distributed import cleanup_dist_env_and_memory

    extra = {"enable_expert_parallel": True} if expert_parallel else {}
    if block_size:
        extra["block_size"] = block_size
    if model_impl:
        extra["model_impl"] = model_impl
    with _FusedLines() as fused:
        llm = start_llm(model_dir, arch, tp, pp, dtype=dtype, **extra)
    result_fused = fused.lines
    try:
        impls = set(llm.apply_model(model_class_name))
        rank_bytes = llm.apply_model(body_bytes)
        tokens, logprobs = greedy(llm, prompts, max_tokens)
    finally:
        del llm
        cleanup_dist_env_and_memory()
    if len(impls) != 1:
        raise RuntimeError(f"ranks ran different classes: {sorted(impls)}")
    return EngineResult(impls.pop(), tokens, logprobs, result_fused, rank_bytes)
