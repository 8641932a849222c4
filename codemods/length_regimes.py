"""Lengths at which a model starts to compute something else, inside the tiny prompts.

A config keeps lengths that change what attention computes past them: a sliding window,
an attention chunk (Llama 4's 8192), a scale that switches on past a position
(`floor_scale`), a block-sparse selection, rope scaling's original length. Left at
their published values in a tiny model, verification's prompts (at most 55 tokens)
never reach them, and a file that ignores them verifies. The tiny rules shrink the
fields they know by name (`tiny.feature_values`); this finds the rest by what they do,
over every integer field of the config, so a field nobody named is found too:

    a field is a length regime when setting it to `SMALL` keeps every parameter's shape
    (not a size), leaves the logits of a `SHORT`-token prompt as they were and changes
    those of a `LONG`-token prompt (the same weights): a scale or a rotary size changes
    every length, a window, a chunk or a scale switched on past a position only the
    long one.

Each one found is set to `SMALL`, which the verification prompts (and the apply probe)
run past.
"""

from __future__ import annotations

import json

SMALL = 32  # inside verify's prompts; a multiple of the CPU attention's block size
LONG = 64  # past SMALL in the detection forward
SHORT = 16  # inside SMALL
TOLERANCE = 1e-5


def _int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def candidates(config) -> list[tuple[str, ...]]:
    """Paths of the integer fields above SMALL, top level and one or two dicts deep
    (`rope_parameters`, a sub-config's dict, a per-layer-type rope)."""
    out = []
    for key, value in config.to_dict().items():
        if key.startswith("_") or key.endswith("_token_id") or key == "vocab_size":
            continue
        if _int(value) and value > SMALL:
            out.append((key,))
        elif isinstance(value, dict):
            for k2, v2 in value.items():
                if _int(v2) and v2 > SMALL:
                    out.append((key, k2))
                elif isinstance(v2, dict):
                    out += [
                        (key, k2, k3)
                        for k3, v3 in v2.items()
                        if _int(v3) and v3 > SMALL
                    ]
    return out


def with_value(values: dict, config, path: tuple[str, ...], new) -> dict:
    """`values` with the field at `path` set to `new` (a nested dict copied whole)."""
    out = json.loads(json.dumps(values))
    if len(path) == 1:
        out[path[0]] = new
        return out
    top = json.loads(json.dumps(out.get(path[0], config.to_dict().get(path[0]))))
    node = top
    for key in path[1:-1]:
        node = node[key]
    node[path[-1]] = new
    out[path[0]] = top
    return out


def _build(causal_cls, values, device=None):
    import torch

    config = causal_cls.config_class(**values)
    config._attn_implementation = "eager"
    if device == "meta":
        with torch.device("meta"):
            return causal_cls(config)
    torch.manual_seed(0)
    return causal_cls(config).float().eval()


def _shapes(model) -> dict:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def detect(causal_cls, values: dict) -> list[tuple[str, ...]]:
    """The fields of `values`' config that are length regimes beyond SMALL."""
    import torch

    from .tiny_model import randomize

    model = _build(causal_cls, values)
    randomize(model)
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    ids = torch.randint(
        0,
        model.config.vocab_size,
        (1, LONG),
        generator=torch.Generator().manual_seed(5),
    )
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        ref_short = model(input_ids=ids[:, :SHORT], use_cache=False).logits
    scale = ref.abs().max().item() or 1.0
    found = []
    for path in candidates(model.config):
        trial = with_value(values, model.config, path, SMALL)
        try:
            if _shapes(_build(causal_cls, trial, "meta")) != shapes:
                continue  # a size: it changes the weights, not a regime
            other = _build(causal_cls, trial)
            other.load_state_dict(state, strict=True)
            with torch.no_grad():
                out = other(input_ids=ids, use_cache=False).logits
                short = other(input_ids=ids[:, :SHORT], use_cache=False).logits
        except Exception:  # noqa: BLE001 - a limit (too short to run), not a regime
            continue
        if out.shape != ref.shape or short.shape != ref_short.shape:
            continue
        same_short = (short - ref_short).abs().max().item() / scale <= TOLERANCE
        if same_short and (out - ref).abs().max().item() / scale > TOLERANCE:
            found.append(path)
    return found


_CACHE: dict[tuple, list] = {}


def shrink(causal_cls, values: dict, keep: set[str] = frozenset()) -> dict:
    """`values` with every length regime beyond SMALL set to SMALL (fields in `keep`,
    the ones a caller set, stay); unchanged where the model then fails to run."""
    from .tiny_model import check_runs

    key = (causal_cls, json.dumps(values, sort_keys=True, default=str))
    if key not in _CACHE:
        try:
            _CACHE[key] = detect(causal_cls, values)
        except Exception:  # noqa: BLE001 - cannot even run long: nothing found
            _CACHE[key] = []
    out = values
    config = causal_cls.config_class(**values)
    for path in _CACHE[key]:
        if path[0] in keep:
            continue
        trial = with_value(out, config, path, SMALL)
        try:
            check_runs(causal_cls, trial)
        except Exception:  # noqa: BLE001 - the test over committed models reports it
            continue
        out = trial
    return out


def remaining(causal_cls, values: dict) -> list[str]:
    """The length regimes `values` still leaves beyond SMALL, as dotted paths."""
    return [".".join(p) for p in detect(causal_cls, values)]
