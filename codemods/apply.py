"""`python -m codemods.apply modeling_x.py`: generate the native vLLM file for one model.

Follows black's conventions: `--check` writes nothing and exits 1 when the file on disk
would change, `--diff` prints the unified diff and writes nothing. Exit 2, with one line
on stderr, when the input cannot be turned into a correct model; nothing is written then.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import manifest
from .claims import pattern_names
from .errors import CodemodError
from .files import DEFAULT_OUT, unified_diff, write_atomic
from .logs import quiet_vllm_logging
from .pipeline import generate
from .plan import Plan

__all__ = ["generate", "main", "output_path"]


def internal_error(exc: BaseException) -> str:
    """One line for a toolkit bug, naming where it happened."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = next(
        (
            f"{Path(f.filename).name}:{f.lineno}"
            for f in reversed(frames)
            if "codemods" in f.filename or "fusion_patterns" in f.filename
        ),
        "?",
    )
    text = str(exc).splitlines()[0] if str(exc) else ""
    return (
        f"internal error at {where}: {type(exc).__name__}: {text} "
        "(a toolkit bug; CODEMODS_DEBUG=1 shows the traceback)"
    )


def output_path(model_plan: Plan, out_dir: Path) -> Path:
    return out_dir / f"{model_plan.source.model_type}.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m codemods.apply", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "source",
        help="modeling_<type>.py: a bare name (installed transformers) or a path",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="output folder (default: generated/)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the file would change",
    )
    mode.add_argument(
        "--diff", action="store_true", help="print the unified diff; write nothing"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no fusion report")
    parser.add_argument(
        "--accept-lost-fusions",
        action="store_true",
        help="write even if the manifest records fusions this regeneration no longer produces",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow running a modeling file that is not part of the installed transformers (the proofs run it)",
    )
    parser.add_argument(
        "--disable",
        action="append",
        default=[],
        metavar="PATTERN",
        choices=pattern_names(),
        help="do not run this fusion pattern (the parts it would claim are copied from "
        "the source); repeatable. Patterns: " + ", ".join(pattern_names()),
    )
    args = parser.parse_args(argv)
    quiet_vllm_logging()

    try:
        model_plan, text = generate(
            args.source, args.trust_remote_code, frozenset(args.disable)
        )
    except CodemodError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:  # a toolkit bug: one line, never a half-written file
        if os.environ.get("CODEMODS_DEBUG"):
            raise
        print(f"error: {internal_error(exc)}", file=sys.stderr)
        return 2
    if not args.quiet:
        for line in model_plan.report():
            print(line, file=sys.stderr)

    path = output_path(model_plan, args.out)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    try:
        recorded = manifest.read(args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    new_entry = manifest.entry(model_plan)
    key = path.stem
    lost = manifest.lost_fusions(recorded.get(key, {}), new_entry)
    if lost and not args.accept_lost_fusions:
        print(
            f"error: regenerating {path.name} loses fusions recorded in {manifest.NAME}: "
            f"{'; '.join(lost)} (pass --accept-lost-fusions to accept)",
            file=sys.stderr,
        )
        return 1
    new_manifest = manifest.render({**recorded, key: new_entry})
    old_manifest = manifest.render(recorded) if recorded else ""
    if args.diff:
        sys.stdout.write(unified_diff(old, text, path))
        sys.stdout.write(
            unified_diff(old_manifest, new_manifest, args.out / manifest.NAME)
        )
        return 0
    if args.check:
        stale = [
            p
            for p, a, b in (
                (path, old, text),
                (args.out / manifest.NAME, old_manifest, new_manifest),
            )
            if a != b
        ]
        for p in stale:
            print(f"would regenerate {p}", file=sys.stderr)
        if not stale:
            print(f"{path} is current", file=sys.stderr)
        return 1 if stale else 0
    if old == text and old_manifest == new_manifest:
        print(f"unchanged {path}", file=sys.stderr)
        return 0
    write_atomic(path, text)
    write_atomic(args.out / manifest.NAME, new_manifest)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
