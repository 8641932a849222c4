"""`python -m codemods.verify <arch | generated file>`: the generated model in real vLLM
against transformers on the same tiny random checkpoint.

Exit 0 when it matches (the generated class ran, greedy tokens identical, logprobs
within 1e-4 in fp32), 1 when it ran and differs, 2 when it could not generate or run.
The last line printed is one JSON object (with `--all`, a table, then one JSON object
per model).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
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
    try:
        head = path.read_text(encoding="utf-8")[:8192]
    except (OSError, UnicodeDecodeError) as exc:
        raise CodemodError(f"{path}: cannot read: {exc}") from None
    fields = dict(re.findall(r"^# (source|architecture):\s+(.+)$", head, re.MULTILINE))
    if (
        "source" not in fields
        or "architecture" not in fields
        or "->" not in fields["architecture"]
    ):
        raise CodemodError(
            f"{path}: not a generated file (its header names no source/architecture)"
        )
    fields["fused"] = str(len(re.findall(r"^#\s+Fused: ", head, re.MULTILINE)))
    fields["refused"] = str(len(re.findall(r"^#\s+Refused: ", head, re.MULTILINE)))
    fields["unfused"] = str(len(re.findall(r"^#\s+Unfused: ", head, re.MULTILINE)))
    fields["environment"] = dict(
        re.findall(r"^# environment:\s+(\w+)=(\S+)", head, re.MULTILINE)
    )
    return fields


def generated_models() -> list[str]:
    return sorted(p.stem for p in GENERATED.glob("*.py") if not p.name.startswith("_"))


def resolve_target(target: str) -> Path:
    path = Path(target)
    if path.suffix == ".py":
        if not path.exists():
            raise CodemodError(f"{target}: no such file")
        return path
    path = GENERATED / f"{target}.py"
    if not path.exists():
        raise CodemodError(
            f"{target}: no generated model of that name (have: {', '.join(generated_models())})"
        )
    return path


def reference_class(source: str, class_name: str, trust_remote_code: bool):
    """The transformers class the generated file was made from, imported from its source."""
    from . import loading
    from .source import load

    if source.startswith("transformers/"):
        return getattr(
            importlib.import_module(source[: -len(".py")].replace("/", ".")), class_name
        )
    return loading.model_classes(load(source), class_name, trust_remote_code)


def is_generated(path: Path) -> bool:
    try:
        read_header(path)
        return True
    except CodemodError:
        return False


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS
    ]


def parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise CodemodError(f"--override {text!r}: expected key=value")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        raise CodemodError(
            f"--override {text!r}: the value is not JSON (strings need quotes)"
        ) from None


def load_config_json(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodemodError(f"--config {path}: {exc}") from None


def verify(
    target: str,
    tp: int = 1,
    pp: int = 1,
    overrides: dict | None = None,
    config_json: dict | None = None,
    trust_remote_code: bool = False,
    layout: str = "saved",
    expert_parallel: bool = False,
    backend: bool = False,
) -> dict:
    """Verify a generated model, or a modeling file (generated into a temporary folder
    and compared against that same file's model)."""
    options = dict(
        tp=tp,
        pp=pp,
        overrides=overrides,
        config_json=config_json,
        trust_remote_code=trust_remote_code,
        layout=layout,
        expert_parallel=expert_parallel,
        backend=backend,
    )
    path = resolve_target(target)
    if is_generated(path):
        return _verify_generated(path, **options)
    from .apply import generate, output_path

    model_plan, text = generate(str(path), trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="verify-source-") as tmp:
        out = output_path(model_plan, Path(tmp))
        out.write_text(text, encoding="utf-8")
        return _verify_generated(out, **options)


def _verify_generated(
    path: Path,
    tp,
    pp,
    overrides,
    config_json,
    trust_remote_code,
    layout,
    expert_parallel,
    backend=False,
) -> dict:
    from . import engine, reference, registration, tiny

    header = read_header(path)
    for key, value in header.get("environment", {}).items():
        os.environ[key] = value  # what the file says vLLM must run it with
    arch, causal_name = (s.strip() for s in header["architecture"].split("->"))
    causal_cls = reference_class(
        header["source"].strip(), causal_name, trust_remote_code
    )
    config_cls = causal_cls.config_class
    raw = None
    if config_json is not None:
        raw = tiny.shrink(config_json, overrides)
        adjusted = tiny.fit_parallel(raw, tp, pp)
        config = config_cls.from_dict(raw)
    else:
        try:
            values = tiny.working_values(causal_cls, overrides)
        except Exception as exc:  # the source's own model fails: say so in one line
            raise CodemodError(
                f"cannot build a tiny {causal_name} from the source: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        adjusted = tiny.fit_parallel(values, tp, pp)
        config = config_cls(**values)
    result = {
        "arch": path.stem,
        "impl": None,
        "tp": tp,
        "pp": pp,
        "features": tiny.features_on(config),
        "fused": int(header["fused"]),
        "refused": int(header["refused"]),
        "unfused": int(header["unfused"]),
    }
    if layout != "saved":
        result["layout"] = layout
    if expert_parallel:
        result["expert_parallel"] = True
    if adjusted:
        result["adjusted"] = adjusted
        for note in adjusted:
            print(f"note: {note}", file=sys.stderr)
    expected_module = f"generated.{path.stem}"
    with tempfile.TemporaryDirectory(prefix=f"verify-{path.stem}-") as tmp:
        if path.resolve().parent != GENERATED:
            plugin_dir = Path(tmp) / "plugin"
            plugin_dir.mkdir()
            arch, expected_module = registration.register_external(
                path, causal_name, plugin_dir
            )
        ckpt = Path(tmp) / "checkpoint"
        model = tiny.build_checkpoint(
            causal_cls, config, ckpt, raw_config=raw, layout=layout
        )
        prompts = prompts_for(model.config.vocab_size)
        ref = reference.greedy_with_logprobs(model, prompts, MAX_TOKENS)
        del model
        ran = engine.run(
            str(ckpt),
            arch,
            prompts,
            MAX_TOKENS,
            tp=tp,
            pp=pp,
            expert_parallel=expert_parallel,
        )
        if backend:
            result["backend"] = _backend(str(ckpt), causal_name, prompts, ref, tp, pp)

    max_diff, tokens_equal = compare(prompts, ref, ran)
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


BACKEND_MODULE = "vllm.model_executor.models.transformers"


def _backend(ckpt: str, arch: str, prompts, ref, tp: int, pp: int) -> dict:
    """vLLM's Transformers backend on the same checkpoint, for comparison."""
    from . import engine

    try:
        ran = engine.run(
            ckpt, arch, prompts, MAX_TOKENS, tp=tp, pp=pp, model_impl="transformers"
        )
    except Exception as exc:  # the backend cannot serve it: say why, in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return {"ok": False, "error": f"{type(exc).__name__}: {first}"[:300]}
    max_diff, tokens_equal = compare(prompts, ref, ran)
    ran_backend = ran.impl.startswith(BACKEND_MODULE)
    out = {
        "impl": ran.impl,
        "max_abs_logprob_diff": max_diff,
        "tokens_equal": tokens_equal,
        "ok": bool(ran_backend and tokens_equal and max_diff <= TOLERANCE),
        "fused": ran.fused or [],
    }
    if not ran_backend:
        out["error"] = f"vLLM ran {ran.impl}, not its Transformers backend"
    return out


def compare(prompts, ref, ran) -> tuple[float, bool]:
    """(max |logprob difference| along the shared greedy path, greedy tokens equal)."""
    diffs, tokens_equal = [], True
    for prompt, (ref_tokens, ref_lp), tokens, lps in zip(
        prompts, ref, ran.tokens, ran.logprobs
    ):
        tokens_equal &= ref_tokens == tokens
        seq = prompt + ref_tokens
        want = [
            float(ref_lp[i - 1, seq[i]]) for i in range(1, len(prompt) + len(tokens))
        ]
        # compare as far as both followed the same tokens
        same = next(
            (i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b),
            len(tokens),
        )
        n = len(prompt) - 1 + same + (1 if same < len(tokens) else 0)
        diffs += [abs(a - b) for a, b in zip(want[:n], lps[:n])]
    return (max(diffs) if diffs else float("inf")), tokens_equal


def _safe_verify(target: str, **kwargs) -> tuple[int, dict]:
    try:
        result = verify(target, **kwargs)
    except CodemodError as exc:
        return 2, {"arch": target, "ok": False, "error": str(exc)}
    except Exception as exc:  # the engine could not build or run the model
        if os.environ.get("CODEMODS_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return 2, {
            "arch": target,
            "ok": False,
            "error": f"could not run: {type(exc).__name__}: {first}"[:500],
        }
    return (0 if result["ok"] else 1), result


def table(rows: list[dict]) -> str:
    head = (
        "arch",
        "tp",
        "pp",
        "features on",
        "fused",
        "refused",
        "max |dlogprob|",
        "tokens equal",
        "ok",
    )
    lines = [head]
    for r in rows:
        diff = r.get("max_abs_logprob_diff")
        lines.append(
            (
                r["arch"],
                str(r.get("tp", "")),
                str(r.get("pp", "")),
                ", ".join(r.get("features", [])) or "-",
                str(r.get("fused", "")),
                str(r.get("refused", "")),
                f"{diff:.2e}" if isinstance(diff, float) else "-",
                str(r.get("tokens_equal", "-")),
                "ok" if r["ok"] else f"FAIL {r.get('error', '')}".strip(),
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
        for row in lines
    )


def tiny_layouts() -> tuple[str, ...]:
    from .tiny import LAYOUTS

    return LAYOUTS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m codemods.verify", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "target",
        nargs="?",
        help="model type in generated/ (e.g. qwen3) or a generated file's path",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="verify every generated model and print a table",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="a real checkpoint's config.json: kept, sizes shrunk",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="set a config field (repeatable)",
    )
    parser.add_argument(
        "--ep",
        action="store_true",
        help="expert parallelism: MoE experts split over the --tp ranks (enable_expert_parallel)",
    )
    parser.add_argument(
        "--layout",
        choices=tiny_layouts(),
        default="saved",
        help="checkpoint names: as save_pretrained writes them (published, per-expert "
        "MoE tensors) or the model's in-memory state dict (stacked experts)",
    )
    parser.add_argument(
        "--backend",
        action="store_true",
        help="also run vLLM's Transformers backend on the same checkpoint, for comparison",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow running a modeling file that is not part of the installed transformers",
    )
    args = parser.parse_args(argv)
    if bool(args.all) == bool(args.target):
        parser.error("give one model (or a generated file), or --all")
    try:
        overrides = dict(parse_override(o) for o in args.override)
        config_json = load_config_json(args.config) if args.config else None
    except CodemodError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kwargs = {
        "tp": args.tp,
        "pp": args.pp,
        "overrides": overrides,
        "config_json": config_json,
        "trust_remote_code": args.trust_remote_code,
        "layout": args.layout,
        "expert_parallel": args.ep,
        "backend": args.backend,
    }
    targets = generated_models() if args.all else [args.target]
    results = [_safe_verify(t, **kwargs) for t in targets]
    if args.all:
        print(table([r for _, r in results]))
    for code, result in results:
        if code == 2:
            print(f"error: {result['arch']}: {result['error']}", file=sys.stderr)
    for _, result in results:
        print(json.dumps(result))
    return max(code for code, _ in results)


if __name__ == "__main__":
    sys.exit(main())
