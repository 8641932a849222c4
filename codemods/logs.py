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
    # transformers' notes about the tiny configs the proofs build (token ids outside
    # the shrunk vocabulary, rope fields) are not the user's business; by its environment
    # variable when it is not imported yet (importing it costs a warm `check` a second)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    else:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
