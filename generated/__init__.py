"""Generated native vLLM model files, and the plugin that registers them with vLLM.

`register` is the `vllm.general_plugins` entry point: vLLM calls it once in every
process it starts (engine and workers), so the generated classes resolve everywhere.
Each generated file names its architecture in its header; nothing here is edited by
hand when a model is added.
"""

from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
ARCH_LINE = re.compile(r"^# architecture:\s+(\w+) -> (\w+)$", re.MULTILINE)


def architectures() -> dict[str, str]:
    """{registered architecture: "generated.<module>:<class>"} read from the file headers."""
    out = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("_"):
            continue
        with path.open(encoding="utf-8") as f:
            head = f.read(4096)
        if found := ARCH_LINE.search(head):
            out[found.group(1)] = f"{__name__}.{path.stem}:{found.group(2)}"
    return out


def register() -> None:
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, target in architectures().items():
        if arch not in supported:  # idempotent: the plugin may run more than once
            ModelRegistry.register_model(arch, target)
