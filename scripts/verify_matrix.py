"""Verify every generated model at TP=1, TP=2 and PP=2 in real vLLM and print a table.

    python scripts/verify_matrix.py [arch ...] [--json results.json]

Each cell is one `python -m codemods.verify <arch> [--tp 2 | --pp 2]` in a fresh process
(as a user would run it); the cell shows ok / FAIL with the max logprob difference.
Exit 0 only when every cell passes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COLUMNS = {"TP=1": [], "TP=2": ["--tp", "2"], "PP=2": ["--pp", "2"]}


def run_cell(arch: str, extra: list[str]) -> dict:
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "codemods.verify", arch, *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    lines = proc.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        result = {
            "ok": False,
            "error": (proc.stderr.strip().splitlines() or ["no output"])[-1],
        }
    result["exit"] = proc.returncode
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def cell_text(result: dict) -> str:
    if result.get("ok"):
        return f"ok ({result['max_abs_logprob_diff']:.1e})"
    return f"FAIL: {result.get('error') or 'differs'}"[:60]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", nargs="*", help="default: every model in generated/")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    archs = args.archs or sorted(
        p.stem for p in (REPO / "generated").glob("*.py") if not p.name.startswith("_")
    )
    results = {}
    for arch in archs:
        for column, extra in COLUMNS.items():
            results[(arch, column)] = run_cell(arch, extra)
            print(
                f"{arch} {column}: {cell_text(results[(arch, column)])}",
                file=sys.stderr,
                flush=True,
            )
    rows = [("arch", *COLUMNS)] + [
        (a, *(cell_text(results[(a, c)]) for c in COLUMNS)) for a in archs
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if args.json:
        args.json.write_text(
            json.dumps({f"{a} {c}": r for (a, c), r in results.items()}, indent=2)
            + "\n"
        )
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
