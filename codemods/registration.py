"""Make a generated file that is not in `generated/` resolvable in every vLLM process.

vLLM runs `vllm.general_plugins` entry points in each process it starts; an entry point
only needs a `<name>.dist-info` folder on the path. So a temporary copy of a generated
file (a hand-edited one, or one generated into a temporary folder from a modeling file
elsewhere) gets its own module name, architecture name and plugin in a work folder that
is put on `sys.path` here and on `PYTHONPATH` for the workers.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import sys
from pathlib import Path


def register_external(
    generated_file: Path, causal_name: str, workdir: Path
) -> tuple[str, str]:
    """(architecture name, module name) under which `generated_file` is registered."""
    token = hashlib.sha256(generated_file.read_bytes()).hexdigest()[:12]
    module = f"_verify_{generated_file.stem}_{token}"
    arch = f"Verify{token}{causal_name}"
    (workdir / f"{module}.py").write_bytes(generated_file.read_bytes())
    (workdir / f"{module}_plugin.py").write_text(
        "def register():\n"
        "    from vllm import ModelRegistry\n\n"
        f"    if {arch!r} not in ModelRegistry.get_supported_archs():\n"
        f"        ModelRegistry.register_model({arch!r}, {f'{module}:{causal_name}'!r})\n"
        + (
            "    from generated import set_up\n\n" f"    set_up({arch!r}, {setup!r})\n"
            if (setup := vllm_config_of(generated_file))
            else ""
        )
    )
    dist_info = workdir / f"{module}_plugin-0.0.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {module}-plugin\nVersion: 0.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{module} = {module}_plugin:register\n"
    )
    sys.path.insert(0, str(workdir))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(workdir), os.environ.get("PYTHONPATH")])
    )
    importlib.invalidate_caches()
    # this process may have run its plugins already
    importlib.import_module(f"{module}_plugin").register()
    return arch, module


def vllm_config_of(generated_file: Path) -> str:
    """The vLLM config class a generated file's header says it is set up with."""
    from generated import CONFIG_LINE

    found = CONFIG_LINE.search(generated_file.read_text()[:8192])
    return found.group(1) if found else ""
