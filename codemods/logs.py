"""Keep vLLM's import-time warnings out of the command lines that only build its layers."""

from __future__ import annotations

import logging
import os
import sys


def quiet_vllm_logging() -> None:
    """For apply and check (no engine): vLLM's warnings about the CPU build (no Triton, and
    so on) would bury the fusion report. Only before vLLM is imported."""
    if "vllm" not in sys.modules:
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        logging.getLogger("vllm").setLevel(logging.ERROR)
