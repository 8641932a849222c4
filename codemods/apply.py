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

from . import layer_kinds, manifest
from .emit import emit_body
from .errors import CodemodError
from . import faithful
from .faithful import FaithfulPlan
from .files import DEFAULT_OUT, unified_diff, write_atomic
from .plan import ModelPlan, plan
from .render import render
from .source import load
from .structure import analyse, class_infos
from .logs import quiet_vllm_logging
from .validate import validate


def generate(
    name: str, trust_remote_code: bool = False, layout: str = "auto"
) -> tuple[ModelPlan | FaithfulPlan, str]:
    """The plan and the full text of the generated file for one modeling file:
    source -> match -> validate -> plan -> emit -> render.

    The native layout (every part fused into vLLM's own layout) is tried first; where
    it cannot be proven, the faithful layout emits every class from its source and
    fuses the parts the patterns prove (layout="faithful" forces it)."""
    source = load(name)
    # every kind of layer the source can build, in the tiny configs that build them
    causal_cls, kinds = layer_kinds.for_source(source, trust_remote_code)
    values = None
    if kinds is not None:
        layer_kinds.refuse_unservable(causal_cls, kinds, class_infos(source.module))
        values = kinds.primary
    why = "requested with --faithful"
    if layout != "faithful":
        try:
            structure = analyse(source)
            same = (
                causal_cls is not None and structure.causal.name == causal_cls.__name__
            )
            validate(structure, trust_remote_code, values if same else None)
            model_plan = plan(structure)
            return model_plan, render(model_plan, emit_body(model_plan))
        except CodemodError as exc:
            if exc.final:
                raise
            why = str(exc).removeprefix("cannot generate: ")
        except Exception as exc:  # a bug in the native tier must not cost the model
            why = f"native analysis failed: {type(exc).__name__}: {exc}".splitlines()[0]
        if layout == "native":
            raise CodemodError(f"cannot generate the native layout: {why}")
    try:
        model_plan, body = faithful.generate(
            source, trust_remote_code, why=why, values=values
        )
    except CodemodError as exc:
        message = str(exc)
        if (
            layout == "faithful"
            or message.startswith("out of scope")
            or why.startswith("cannot build a tiny")  # the same failure, said once
        ):
            raise
        # both tiers' reasons, on one line: the faithful one is why nothing was written
        raise CodemodError(f"{message} (and the native layout: {why})") from None
    return model_plan, render(model_plan, body)


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


def output_path(model_plan: ModelPlan, out_dir: Path) -> Path:
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
        "--faithful",
        action="store_true",
        help="emit every class from its source (no native layout); fusions still apply per part",
    )
    args = parser.parse_args(argv)
    quiet_vllm_logging()

    try:
        model_plan, text = generate(
            args.source,
            args.trust_remote_code,
            layout="faithful" if args.faithful else "auto",
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
