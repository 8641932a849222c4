"""Grouped kv heads in the tiny configs, found by the role of a field, not its name.

A kv-head count equal to the head count hides a whole class of bugs: an attention that
broadcasts its keys to every query head (Falcon's new decoder architecture) and one that
hands vLLM a kv count read from the wrong attribute compute the same thing there. A
config field whose value is the head count, and whose halving shrinks attention weights
and nothing else, is a kv-head count (`num_key_value_heads`, Falcon's `num_kv_heads`,
`kv_n_heads`, ...): it goes below the head count. A field the tiny rules already set
(latent attention's kv heads = heads) is left as set.
"""

from __future__ import annotations

import torch

ATTENTION_WORDS = ("attn", "attention")  # the module path of an attention's weights


def _shapes(causal_cls, config) -> dict[str, tuple] | None:
    """Parameter shapes of the model `config` builds (on the meta device), or None."""
    try:
        with torch.device("meta"):
            model = causal_cls(config)
    except Exception:  # noqa: BLE001 - not buildable on meta, or rejected
        return None
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _only_attention_shrinks(before: dict, after: dict) -> bool:
    """Only attention weights shrink, and only along their outputs (dim 0: fewer key
    and value rows); a linear attention's conv kernel, which may equal the head count,
    shrinks its conv along the kernel's axis instead."""
    if before.keys() != after.keys():
        return False
    changed = [n for n in before if before[n] != after[n]]
    return bool(changed) and all(
        any(w in n.lower() for w in ATTENTION_WORDS)
        and len(after[n]) == len(before[n])
        and after[n][0] < before[n][0]
        and after[n][1:] == before[n][1:]
        for n in changed
    )


def kv_head_values(causal_cls, values: dict) -> dict:
    """{field: head count // 2} for each kv-head count `values` leave at the head count."""
    from .tiny import own_fields

    config_cls = causal_cls.config_class
    try:
        config = config_cls(**values)
    except Exception:  # noqa: BLE001 - the variants say why
        return {}
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 2 or heads % 2:
        return {}
    candidates = [
        name
        for name in own_fields(config_cls)
        if name not in values
        and type(getattr(config, name, None)) is int
        and getattr(config, name) == heads
    ]
    if not candidates:
        return {}
    before = _shapes(causal_cls, config)
    if before is None:
        return {}
    out = {}
    for name in candidates:
        try:
            grouped = config_cls(**{**values, name: heads // 2})
        except Exception:  # noqa: BLE001 - the class rejects grouping
            continue
        after = _shapes(causal_cls, grouped)
        if after is not None and _only_attention_shrinks(before, after):
            out[name] = heads // 2
    return out
