"""Every case of the two largest engine suites, where `make test` runs a sample:

    python scripts/engine_sweep.py            # every mutant and every able-to-fail copy
    python scripts/engine_sweep.py -x -q      # extra arguments go to pytest

The mutation suite (tests/test_mutations.py: each mutant of Qwen3's source verified in
real vLLM) and the able-to-fail copies (tests/test_able_to_fail.py: each feature of a
committed file switched off must fail verification). Run it before resolving an issue
that touches generation or verification; about 25 minutes on 2 cores.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SUITES = ["tests/test_mutations.py", "tests/test_able_to_fail.py"]


def main(argv: list[str]) -> int:
    env = {**os.environ, "CODEMODS_SWEEP": "1"}
    command = [sys.executable, "-m", "pytest", *SUITES, "-rs", *(argv or ["-q"])]
    return subprocess.run(command, cwd=REPO, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
