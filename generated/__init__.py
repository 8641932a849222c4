"""Generated native vLLM model files, and the plugin that registers them with vLLM.

`register` is the `vllm.general_plugins` entry point: vLLM calls it once in every
process it starts (engine and workers), so the generated classes resolve everywhere.
Each generated file names its architecture in its header; nothing here is edited by
hand when a model is added.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCH_LINE = re.compile(r"^# architecture:\s+(\w+) -> (\w+)$", re.MULTILINE)
# a class of vLLM's models/config.py vLLM sets such an architecture up with
CONFIG_LINE = re.compile(r"^# vllm config:\s+(\w+)", re.MULTILINE)


def architectures() -> dict[str, str]:
    """{registered architecture: "generated.<module>:<class>"} read from the file headers."""
    return {arch: target for arch, (target, _) in _headers().items()}


def _headers() -> dict[str, tuple[str, str]]:
    """{architecture: (its target, the vLLM config class it is set up with or "")}."""
    out = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("_"):
            continue
        with path.open(encoding="utf-8") as f:
            head = f.read(8192)
        if found := ARCH_LINE.search(head):
            setup = CONFIG_LINE.search(head)
            out[found.group(1)] = (
                f"{__name__}.{path.stem}:{found.group(2)}",
                setup.group(1) if setup else "",
            )
    return out


def set_up(arch: str, config_class: str) -> None:
    """vLLM sets its own architectures up by name (`MODELS_CONFIG_MAP`): a generated
    one that needs the same setup (a model without attention: its state blocks sized
    by `MambaModelConfig`) is entered under its own name."""
    from vllm.model_executor.models import config

    config.MODELS_CONFIG_MAP.setdefault(arch, getattr(config, config_class))


# Set to 1 to run vLLM's CPU build as on a CPU without AMX tiles. On one with them,
# vLLM 0.32 picks kernels that take bf16/fp16 only for some fp32 layers by their weight
# (a router GEMM, int8 GEMMs), and an fp32 engine then fails, its own classes as much
# as these; the tests and the coverage table set it so every machine runs the same path.
NO_AMX = "CODEMODS_NO_AMX"


def register() -> None:
    from vllm import ModelRegistry

    if os.environ.get(NO_AMX) == "1":
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False

    supported = set(ModelRegistry.get_supported_archs())
    for arch, (target, setup) in _headers().items():
        if arch not in supported:  # idempotent: the plugin may run more than once
            ModelRegistry.register_model(arch, target)
        if setup:
            set_up(arch, setup)
