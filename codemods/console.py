"""What a person reads while `verify` runs: one progress line per step, vLLM's own log
kept aside (shown with `--verbose`, or its tail when something fails)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time

LOG_TAIL = 60  # lines of vLLM's log shown when a run fails


class Progress:
    """`verify qwen3 [2/5] reference: transformers, greedy` lines, to the real stderr even
    while file descriptors 1 and 2 are redirected into the log."""

    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total, self.step = label, total, 0
        self.stream = stream or sys.stderr
        self.start = time.time()

    def __call__(self, what: str) -> None:
        self.step += 1
        elapsed = time.time() - self.start
        print(
            f"verify {self.label} [{self.step}/{self.total}] {what} ({elapsed:.0f} s)",
            file=self.stream,
            flush=True,
        )

    def note(self, text: str) -> None:
        print(f"verify {self.label}: note: {text}", file=self.stream, flush=True)


@contextlib.contextmanager
def captured_output(enabled: bool = True):
    """Redirect file descriptors 1 and 2 (this process and every worker vLLM forks or
    spawns inherits them) into a temporary file; yields (real stderr, log reader)."""
    if not enabled:
        yield sys.stderr, lambda: ""
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    log = tempfile.TemporaryFile(mode="w+b")
    real_err = os.fdopen(os.dup(saved[2]), "w", buffering=1)

    def read() -> str:
        sys.stdout.flush()
        sys.stderr.flush()
        log.seek(0)
        return log.read().decode("utf-8", "replace")

    try:
        for fd in (1, 2):
            os.dup2(log.fileno(), fd)
        yield real_err, read
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        real_err.close()
        log.close()


def tail(text: str, lines: int = LOG_TAIL) -> str:
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join(kept)
