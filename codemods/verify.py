"""`python -m codemods.verify <arch | generated file>`: the generated model in real vLLM
against transformers on the same tiny random checkpoint.

Exit 0 when it matches (the generated class ran, greedy tokens identical, logprobs
within 1e-4 in fp32), 1 when it ran and differs, 2 when it could not generate or run.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import tempfile
from pathlib import Path

from .errors import CodemodError

GENERATED = Path(__file__).resolve().parent.parent / "generated"
TOLERANCE = 1e-4
MAX_TOKENS = 8
PROMPT_LENGTHS = (5, 13, 29, 47)


def read_header(path: Path) -> dict[str, str]:
    head = path.read_text(encoding="utf-8")[:4096]
    fields = dict(re.findall(r"^# (source|architecture):\s+(.+)$", head, re.MULTILINE))
    if "source" not in fields or "architecture" not in fields:
        raise CodemodError(f"{path}: not a generated file (its header names no source/architecture)")
    return fields


def resolve_target(target: str) -> Path:
    path = Path(target)
    if path.suffix == ".py":
        if not path.exists():
            raise CodemodError(f"{target}: no such file")
        return path
    path = GENERATED / f"{target}.py"
    if not path.exists():
        known = sorted(p.stem for p in GENERATED.glob("*.py") if not p.name.startswith("_"))
        raise CodemodError(f"{target}: no generated model of that name (have: {', '.join(known)})")
    return path


def reference_class(source: str, class_name: str):
    if not source.startswith("transformers/"):
        raise CodemodError(f"source {source} is not part of the installed transformers")
    module = importlib.import_module(source[: -len(".py")].replace("/", "."))
    return getattr(module, class_name)


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def verify(target: str, tp: int = 1, pp: int = 1, overrides: dict | None = None) -> dict:
    from . import engine, reference, registration, tiny

    path = resolve_target(target)
    header = read_header(path)
    arch, causal_name = (s.strip() for s in header["architecture"].split("->"))
    causal_cls = reference_class(header["source"].strip(), causal_name)
    config = tiny.tiny_config(causal_cls.config_class, overrides)
    result = {"arch": path.stem, "impl": None, "tp": tp, "pp": pp, "features": tiny.features_on(config)}
    expected_module = f"generated.{path.stem}"
    with tempfile.TemporaryDirectory(prefix=f"verify-{path.stem}-") as tmp:
        if path.resolve().parent != GENERATED:
            plugin_dir = Path(tmp) / "plugin"
            plugin_dir.mkdir()
            arch, expected_module = registration.register_external(path, causal_name, plugin_dir)
        ckpt = Path(tmp) / "checkpoint"
        model = tiny.build_checkpoint(causal_cls, config, ckpt)
        model.config._attn_implementation = "eager"
        prompts = prompts_for(config.vocab_size)
        ref = reference.greedy_with_logprobs(model, prompts, MAX_TOKENS)
        del model
        ran = engine.run(str(ckpt), arch, prompts, MAX_TOKENS, tp=tp, pp=pp)

    diffs, tokens_equal = [], True
    for prompt, (ref_tokens, ref_lp), tokens, lps in zip(prompts, ref, ran.tokens, ran.logprobs):
        tokens_equal &= ref_tokens == tokens
        seq = prompt + ref_tokens
        want = [float(ref_lp[i - 1, seq[i]]) for i in range(1, len(prompt) + len(tokens))]
        # compare as far as both followed the same tokens
        n = len(prompt) - 1 + next((i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b), len(tokens))
        diffs += [abs(a - b) for a, b in zip(want[: n + 1], lps[: n + 1])]
    max_diff = max(diffs) if diffs else float("inf")
    generated_ran = ran.impl.startswith(f"{expected_module}:")
    result.update(
        impl=ran.impl,
        max_abs_logprob_diff=max_diff,
        tokens_equal=tokens_equal,
        ok=bool(generated_ran and tokens_equal and max_diff <= TOLERANCE),
    )
    if not generated_ran:
        result["error"] = f"vLLM ran {ran.impl}, not the generated class"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codemods.verify", description=__doc__.splitlines()[0])
    parser.add_argument("target", help="model type of a file in generated/ (e.g. qwen3) or a generated file's path")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    args = parser.parse_args(argv)
    try:
        result = verify(args.target, tp=args.tp, pp=args.pp)
    except CodemodError as exc:
        print(f"error: {exc}", file=sys.stderr)
        print(json.dumps({"arch": args.target, "ok": False, "error": str(exc)}))
        return 2
    except Exception as exc:  # the engine failed to build or run the model
        print(f"error: could not run: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        print(json.dumps({"arch": args.target, "tp": args.tp, "pp": args.pp, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}))
        return 2
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
