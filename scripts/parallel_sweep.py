"""Every faithful kind (and the native sample) at TP=2 and PP=2 in real vLLM, one
engine at a time; `make test` runs one layout per kind, this runs the grid.

    python scripts/parallel_sweep.py                      # the default grid
    python scripts/parallel_sweep.py --models gpt2,phi    # some models

Prints one line per run and a summary; exit 1 if any run fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# a faithful attention with QKV fused inside it, a faithful MoE block, a parallel
# attention + MLP layer, a GPT-2-style model, a model's own eager attention (ALiBi,
# local windows), a pass-through wrapper; the native dense and fused-MoE/MLA files
DEFAULT = (
    "granite_swa,afmoe,phi,gpt2,bloom,gpt_neo,opt,qwen3,qwen3_moe,mixtral,deepseek_v3"
)
LAYOUTS = {"tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    args = parser.parse_args(argv)
    failed = 0
    rows = []
    for model in args.models.split(","):
        for name, flags in LAYOUTS.items():
            start = time.time()
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "codemods.verify", model, *flags],
                    cwd=REPO,
                    capture_output=True,
                    text=True,
                    timeout=args.timeout,
                )
                last = (proc.stdout.strip().splitlines() or [""])[-1]
                out = (
                    json.loads(last)
                    if last.startswith("{")
                    else {"error": proc.stderr[-300:]}
                )
            except subprocess.TimeoutExpired:
                out = {"error": f"timed out after {args.timeout} s"}
            ok = bool(out.get("ok"))
            failed += not ok
            detail = (
                f"max |dlogprob| {out.get('max_abs_logprob_diff', float('nan')):.1e}, {out.get('impl')}"
                if ok
                else (out.get("error") or json.dumps(out))[:300]
            )
            rows.append((model, name, ok))
            print(
                f"{model:12s} {name}: {'ok' if ok else 'FAIL'} ({detail}) {time.time() - start:.0f}s",
                flush=True,
            )
    print(f"{len(rows) - failed}/{len(rows)} runs verified")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
