"""Checkpoint names transformers renames at load time, for the generated loader.

transformers v5 keeps a table of renames per class or model type (its conversion
mapping): published checkpoints keep their original names (GPT-NeoX's head is saved as
`embed_out`, the modeling file names it `lm_head`). The generated model is named like
the modeling file, so its loader applies the same renames. Only plain renames are
emitted; a conversion that reshapes or stacks tensors is refused (not emitted yet).
"""

from __future__ import annotations

import re

from .errors import CodemodError

# a regex that is a literal string, optionally anchored at the start
_LITERAL = re.compile(r"^\^?(?:[\w\-]|\\\.)+$")


def renames(causal_cls, model_type: str) -> dict[str, dict[str, str]]:
    """{"orig_to_new_prefix" | "orig_to_new_substr": {old: new}} for vLLM's WeightsMapper."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    name = causal_cls.__name__
    conversions = (
        get_checkpoint_conversion_mapping(name)
        or get_checkpoint_conversion_mapping(model_type)
        or []
    )
    out: dict[str, dict[str, str]] = {}
    for conversion in conversions:
        sources, targets = conversion.source_patterns, conversion.target_patterns
        if type(conversion) is not WeightRenaming or len(sources) != 1:
            raise CodemodError(
                f"cannot generate: transformers converts {name} checkpoints with "
                f"{type(conversion).__name__} {sources} -> {targets}, not emitted yet"
            )
        source, target = sources[0], targets[0]
        if not _LITERAL.match(source):
            raise CodemodError(
                f"cannot generate: transformers renames {name} checkpoint keys by the regex {source!r}, not emitted yet"
            )
        kind = "orig_to_new_prefix" if source.startswith("^") else "orig_to_new_substr"
        literal = source.lstrip("^").replace("\\.", ".")
        out.setdefault(kind, {})[literal] = target
    return out
