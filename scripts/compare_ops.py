"""The torch ops one decode step runs, generated class vs vLLM's native class.

    python scripts/compare_ops.py llama
    python scripts/compare_ops.py gemma3 --transformers   # against the Transformers backend
    python scripts/compare_ops.py falcon --override ffn_hidden_size=2048  # as benchmarked
    python scripts/compare_ops.py bloom --prefill 256   # one prompt's prefill instead

Timings on a shared 2-core machine are noisy; op counts are not. This serves the same
random checkpoint with each implementation, profiles a few greedy decode steps of one
request, and prints per-op call counts per step for both, with the differences, so a
ratio below 1.00x in the benchmark can be told apart from a real extra cost. With
`--prefill N` it profiles the prefill of one N-token prompt instead (the benchmark's
throughput case is mostly prefill: 16 prompts of 256 tokens).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

STEPS = 8
TOP = 12


def op_counts(
    ckpt: str, arch: str | None, prefill: int | None = None
) -> tuple[str, collections.Counter, collections.Counter]:
    """Per decode step (or per prefill of a `prefill`-token prompt): each aten op's
    calls and its self CPU time in ms. `arch` None: vLLM's Transformers backend."""
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    from codemods.engine import model_class_name, set_cpu_env

    set_cpu_env(1, 1)
    llm = LLM(
        model=ckpt,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=max(256, (prefill or 0) + 16),
        enforce_eager=True,
        **(
            {"hf_overrides": {"architectures": [arch]}}
            if arch
            else {"model_impl": "transformers"}
        ),
    )
    impl = llm.apply_model(model_class_name)[0]
    prompt = [{"prompt_token_ids": [1 + i % 255 for i in range(prefill or 32)]}]

    def run(llm, tokens):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompt, params, use_tqdm=False)

    run(llm, 2)  # warm-up
    counts, times = {}, {}
    for tokens in (1, 1 + STEPS):  # prefill only, then prefill + STEPS decode steps
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
        ) as prof:
            run(llm, tokens)
        ops = [e for e in prof.key_averages() if e.key.startswith(("aten::", "_C"))]
        counts[tokens] = collections.Counter({e.key: e.count for e in ops})
        times[tokens] = collections.Counter(
            {e.key: e.self_cpu_time_total / 1e3 for e in ops}
        )
    del llm
    cleanup_dist_env_and_memory()

    if prefill:
        return impl, counts[1], times[1]

    def per_step(c):
        return collections.Counter({k: v / STEPS for k, v in c.items()})

    return (
        impl,
        per_step(counts[1 + STEPS] - counts[1]),
        per_step(times[1 + STEPS] - times[1]),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="a generated model, e.g. llama")
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="compare with vLLM's Transformers backend instead of its native class",
    )
    parser.add_argument(
        "--override",
        action="append",
        metavar="KEY=JSON",
        help="set a config field of the checkpoint, as the benchmark's --override",
    )
    parser.add_argument(
        "--prefill",
        type=int,
        metavar="TOKENS",
        help="profile the prefill of one prompt of this many tokens, not decode steps",
    )
    args = parser.parse_args(argv)

    import torch
    from benchmark import PRESETS, build_checkpoint, causal_class, parse_overrides

    from codemods.logs import quiet_vllm_logging
    from codemods.verify import read_header

    quiet_vllm_logging()
    header = read_header(REPO / "generated" / f"{args.model}.py")
    arch, causal_name = (s.strip() for s in header["architecture"].split("->"))
    source = header["source"].strip()
    causal_cls = causal_class(source, causal_name)
    with tempfile.TemporaryDirectory() as tmp:
        # the benchmark's own checkpoint (its CPU sizes, every other field at default)
        build_checkpoint(
            causal_cls,
            PRESETS["cpu"]["sizes"],
            tmp,
            0,
            torch.float32,
            source=source,
            overrides=parse_overrides(args.override),
        )
        ours_impl, ours, ours_ms = op_counts(tmp, arch, args.prefill)
        other = None if args.transformers else causal_name
        native_impl, native, native_ms = op_counts(tmp, other, args.prefill)
    label = "backend" if args.transformers else "native"
    step = f"prefill of {args.prefill} tokens" if args.prefill else "decode step"
    print(f"ops per {step}: {ours_impl} vs {native_impl}")
    print(f"{'op':40} {'generated':>10} {label:>10}")
    for op in sorted(ours.keys() | native.keys()):
        if round(ours[op], 2) != round(native[op], 2):
            print(f"{op:40} {ours[op]:10.2f} {native[op]:10.2f}")
    total = {"generated": sum(ours.values()), label: sum(native.values())}
    print(json.dumps({"model": args.model, "ops_per_step": total}))
    print(f"\nself CPU ms per {step} (noisy), the {TOP} largest differences:")
    diffs = sorted(
        ours_ms.keys() | native_ms.keys(),
        key=lambda op: -abs(ours_ms[op] - native_ms[op]),
    )
    for op in diffs[:TOP]:
        print(f"{op:40} {ours_ms[op]:10.3f} {native_ms[op]:10.3f}")
    ms = {"generated": sum(ours_ms.values()), label: sum(native_ms.values())}
    print(json.dumps({"model": args.model, "self_cpu_ms_per_step": ms}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
