"""Tiny random-weight checkpoints built from a model's own config class.

Sizes are shrunk so the model runs on a CPU in seconds; every feature the config class
offers is switched on, with a value that makes a difference, by rules over the class's
own fields (not per architecture): boolean flags off by default go on, multipliers move
away from 1, soft-caps go low enough to bite, sliding windows get shorter than the
prompts and mix with full layers. `shrink` does the same for a real `config.json`,
keeping every value and changing only sizes.
"""

from __future__ import annotations

import functools
import json
import math
import typing
from pathlib import Path

import torch

from .tiny_model import VOCAB, check_runs, randomize

# vLLM's CPU attention supports these head sizes.
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
HEAD_DIM = 64
SIZES = {
    "vocab_size": VOCAB,
    "hidden_size": 320,  # not heads * head_dim: catches a head size derived the wrong way
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": HEAD_DIM,
    "max_position_embeddings": 512,
    # a tiny MoE: few experts, a small top-k, a dense layer among the MoE layers
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "mlp_only_layers": [1],
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    # latent attention: a small q rank and heads; the latent itself keeps its published
    # 512 + 64, the only size vLLM's CPU MLA decode kernel takes
    "q_lora_rank": 96,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    # Mamba-2 mixers: a few heads and a small state; an SSD chunk shorter than the
    # verification prompts, so the scan carries its state across chunks
    "mamba_n_heads": 8,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
    # linear attention (gated DeltaNet): head sizes vLLM's CPU delta-rule kernels take
    # (a derived size, 0.75 * hidden / heads, is not one), more value heads than key
    # heads so a key head serves two
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
# experts sized by `intermediate_size` (Mixtral, GPT-OSS): vLLM's CPU fused-MoE kernel
# tiles the intermediate size by 32 per rank, unpadded for some activations (swigluoai),
# so a multiple of 64 serves two ranks
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")
EXPERT_INTERMEDIATE = 704
# special token ids a config may hold, clamped into the tiny vocabulary
TOKEN_IDS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "cls_token_id",
    "sep_token_id",
    "decoder_start_token_id",
)
# the layer count under the names config classes give it
LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
WINDOW = 8  # shorter than every verification prompt but the first
# Booleans that are not model features (runtime switches, or another kind of model).
NOT_FEATURES = {
    "use_cache",
    "use_bidirectional_attention",
    "return_dict",
    "is_decoder",
    "output_attentions",
    "output_router_logits",
    # another kind of model: encoder-decoder or cross-attending decoders
    "add_cross_attention",
    "is_encoder_decoder",
    "tie_encoder_decoder",
    "cross_attention_hidden_size",
    # how weights are initialised, not what the model computes (and transformers 5.19
    # applies Mamba 2's to weights it has just loaded: its own reference drifts)
    "rescale_prenorm_residual",
}
LAYER_PATTERN = (
    "full_attention",
    "sliding_attention",
    "sliding_attention",
    "full_attention",
)


def own_fields(config_cls) -> dict[str, tuple[object, object]]:
    """{field: (annotation, default)} declared by the config class and its model bases."""
    from transformers import PreTrainedConfig

    out: dict[str, tuple[object, object]] = {}
    for klass in reversed(config_cls.__mro__):
        if (
            not isinstance(klass, type)
            or not issubclass(klass, PreTrainedConfig)
            or klass is PreTrainedConfig
        ):
            continue
        for name, annotation in klass.__dict__.get("__annotations__", {}).items():
            out[name] = (annotation, klass.__dict__.get(name))
    return out


def _is(annotation, kind) -> bool:
    args = typing.get_args(annotation)
    return annotation is kind or kind in args


def _is_list(annotation) -> bool:
    return any(
        typing.get_origin(a) is list for a in (annotation, *typing.get_args(annotation))
    )


@functools.lru_cache(maxsize=None)
def _default(config_cls):
    try:
        return config_cls()
    except Exception:  # noqa: BLE001 - a config that needs arguments: no lists read
        return None


def feature_values(config_cls) -> dict[str, object]:
    """The feature switches for `config_cls`, by rule over its own fields."""
    values: dict[str, object] = {}
    for name, (annotation, default) in own_fields(config_cls).items():
        if (
            _is(annotation, bool)
            and default in (False, None)
            and name not in NOT_FEATURES
        ):
            values[name] = True
        elif "softcap" in name and _is(annotation, float):
            values[name] = 2.0
        elif (
            "multiplier" in name
            or name.startswith("scale_")
            or name in ("logits_scaling", "logit_scale")
        ) and _is(annotation, float):
            values[name] = 0.6 if "multiplier" in name else 2.5
        elif "multiplier" in name and _is_list(annotation):
            # one multiplier per part of a projection (Falcon-H1's z, x, B, C, dt):
            # each its own value, so a part scaled by another's cannot pass
            n = len(getattr(_default(config_cls), name, None) or ())
            values[name] = [round(0.6 + 0.15 * i, 2) for i in range(n)]
        elif name.endswith("norm_before_gate") and default is True:
            # vLLM's gated norms gate first, then normalise; the other order is proven
            # different and refused by the generated file where a config sets it
            values[name] = False
        elif name.startswith("clip_") and _is(annotation, float):
            values[name] = 0.3
        elif name in ("sliding_window", "window_size") and (
            default is None or isinstance(default, int)
        ):
            values[name] = WINDOW
        elif "shared_expert" in name and default is None and _is(annotation, int):
            values[name] = 1  # shared experts on
        elif name == "layer_types":
            values[name] = list(LAYER_PATTERN)
        elif name.endswith("_layer_indices") and default is None:
            # the layers of a second kind (Bamba's attention among Mamba layers), placed
            # as `mixed_layer_types` places them: [first, second, second, first]
            values[name] = [1, 2]
    return values


def source_layer_kinds(causal_cls) -> list[str] | None:
    """The layer types the modeling source names (transformers' allowed layer types
    written as string literals), in the order it first names them; None where the
    source cannot be read."""
    import inspect
    import re
    import sys

    from transformers.configuration_utils import ALLOWED_ATTN_LAYER_TYPES

    try:
        text = inspect.getsource(sys.modules[causal_cls.__module__])
    except (OSError, TypeError, KeyError):
        return None
    named = re.findall(r"[\"']([a-z_]+)[\"']", text)
    return list(dict.fromkeys(n for n in named if n in ALLOWED_ATTN_LAYER_TYPES))


def mixed_layer_types(kinds: list[str] | None) -> list[str]:
    """Four layers mixing the kinds a source builds: full and sliding attention as
    `LAYER_PATTERN` where it names both, else its own kinds (LFM2-MoE's conv and full
    attention), a first kind on both ends."""
    if not kinds or {"full_attention", "sliding_attention"} <= set(kinds):
        return list(LAYER_PATTERN)
    if len(kinds) == 1:
        return kinds * 4
    if len(kinds) == 2:
        return [kinds[0], kinds[1], kinds[1], kinds[0]]
    return [kinds[i % len(kinds)] for i in range(max(4, len(kinds)))]


def fit_layer_kinds(values: dict, fields: dict, field: str | None) -> None:
    """A layer-type list under the config's own name (Zamba 2's `layers_block_type`)
    that its class fills for the full depth: the kinds of that default mixed over the
    tiny depth, which would not validate against it."""
    default = fields.get(field) if field else None
    layers = values.get("num_hidden_layers")
    if field in values or not isinstance(default, list) or not layers:
        return
    if len(default) != layers:
        values[field] = mixed_layer_types(list(dict.fromkeys(default)))
        values["num_hidden_layers"] = len(values[field])


def _fit_counts(values: dict, fields: dict, layers: int) -> None:
    """Counts of some kind of layer (Gemma 3n's `num_kv_shared_layers`) that the
    class's defaults size for its full depth: half the tiny model's layers, so both
    kinds are built; vocabularies beside the main one (its per-layer input
    embeddings' `vocab_size_per_layer_input`) the tiny vocabulary; an experts' top-k
    under its own name, unset where the experts are off by default (Gemma 4's
    `top_k_experts`), the tiny top-k; other expert counts the tiny one."""
    for name, default in fields.items():
        if name in values:
            continue
        if default is None and "expert" in name and ("top_k" in name or "topk" in name):
            values[name] = SIZES["num_experts_per_tok"]
        if not isinstance(default, int) or isinstance(default, bool):
            continue
        if name.startswith("num_") and name.endswith("_layers") and default >= layers:
            values[name] = max(1, layers // 2)
        elif name.endswith("_layer_period") and default >= layers:
            # a kind placed every `period` layers from an offset (Jamba's attention
            # every 8th layer from the 4th): every other layer, so both kinds are built
            values[name] = 2
            offset = name[: -len("period")] + "offset"
            if offset in fields and offset not in values:
                values[offset] = 1
        elif "vocab_size" in name and default > VOCAB:
            values[name] = VOCAB
        elif _counts_experts(name) and default > SIZES["num_experts"]:
            # experts under the config's own name (LongCat-Flash's identity experts,
            # `zero_expert_num`, 256 beside the routed ones): the tiny expert count
            values[name] = SIZES["num_experts"]


def _kinds_lost_at_depth(config_cls, values: dict, fields: dict, layers: int) -> None:
    """A per-layer list the config class derives from its depth, whose kinds the tiny
    depth loses (Gemma 3n's activation sparsity: 0.95 on the first 10 of 35 layers, on
    none of 4): the kinds of its full-depth default spread over the tiny layers in
    their order ([0.95, 0.95, 0.0, 0.0]), so each kind is built and proven."""
    try:
        tiny = config_cls(**values)
    except Exception:  # noqa: BLE001 - values that do not validate yet
        return
    full = next(
        (fields[k] for k in LAYER_FIELDS if isinstance(fields.get(k), int)), None
    )
    own = own_fields(config_cls)
    for name, default in fields.items():
        if (
            name in values
            or own.get(name, (None, 0))[1] is not None  # not derived from the depth
            or not isinstance(default, list)
            or len(default) != full
        ):
            continue
        kinds = list(dict.fromkeys(json.dumps(v) for v in default))
        mine = getattr(tiny, name, None)
        if len(kinds) < 2 or not isinstance(mine, list) or len(mine) != layers:
            continue
        if len({json.dumps(v) for v in mine}) == 1:
            values[name] = [
                json.loads(kinds[i * len(kinds) // layers]) for i in range(layers)
            ]


def _counts_experts(name: str) -> bool:
    """A field counting a kind of expert (not a top-k, a group, or a shared expert)."""
    return (
        "expert" in name
        and "num" in name
        and not any(w in name for w in ("per_tok", "shared", "group", "top"))
    )


def _through_properties(config_cls, fields: dict) -> dict:
    """Sizes a config class derives through a property with a setter instead of a
    field (LongCat-Flash's `num_hidden_layers`, twice its `num_layers`): the fields
    setting the property on a default instance changes."""
    out: dict = {}
    for name, size in SIZES.items():
        prop = getattr(config_cls, name, None)
        if name in fields or not isinstance(prop, property) or prop.fset is None:
            continue
        try:
            config = config_cls()
            setattr(config, name, size)
            after = config.to_dict()
        except Exception:  # noqa: BLE001 - a setter that refuses the tiny size
            continue
        out.update({k: v for k, v in after.items() if fields.get(k) != v})
    return out


def _layer_count(config_cls, values: dict) -> int | None:
    """The tiny model's layer count, under its field or through the class's property."""
    if "num_hidden_layers" in values:
        return values["num_hidden_layers"]
    try:
        return getattr(config_cls(**values), "num_hidden_layers", None)
    except Exception:  # noqa: BLE001 - values that do not validate yet
        return None


def tiny_values(
    config_cls, overrides: dict | None = None, layer_kinds: list[str] | None = None
) -> dict:
    """Config fields of the default tiny model: sizes, every feature on, then overrides.
    `layer_kinds`: the layer types the modeling source names (`source_layer_kinds`)."""
    fields = config_cls().to_dict()
    # sizes under the config's own field names (GPT-2's n_embd for hidden_size, ...)
    alias = getattr(config_cls, "attribute_map", {}) or {}
    values = {alias.get(k, k): v for k, v in SIZES.items() if alias.get(k, k) in fields}
    values.update(_through_properties(config_cls, fields))
    fit_latent_attention(values, fields)
    if "intermediate_size" in values and any(k in fields for k in EXPERT_COUNTS):
        values["intermediate_size"] = EXPERT_INTERMEDIATE
    values.update(feature_values(config_cls))
    # sub-configs (DBRX's attn_config / ffn_config): their features too
    for name, sub_cls in (getattr(config_cls, "sub_configs", None) or {}).items():
        if (
            isinstance(sub_cls, type)
            and name in fields
            and isinstance(fields[name], dict)
        ):
            sub = {k: v for k, v in feature_values(sub_cls).items()}
            if sub:
                values[name] = {**fields[name], **sub}
    if "layer_types" in values:
        values["layer_types"] = mixed_layer_types(layer_kinds)
        values["num_hidden_layers"] = len(values["layer_types"])
    fit_layer_kinds(values, fields, alias.get("layer_types"))
    if layers := _layer_count(config_cls, values):
        _fit_counts(values, fields, layers)
        _kinds_lost_at_depth(config_cls, values, fields, layers)
    ids = {k: fields.get(k) for k in TOKEN_IDS}
    _clamp_token_ids(ids, VOCAB)  # default ids of a full vocabulary (Phi-3's pad 32000)
    values.update({k: v for k, v in ids.items() if v != fields.get(k)})
    values.update(overrides or {})
    return values


def variants(config_cls, values: dict):
    """The tiny values, then fallbacks for sources that constrain sizes or features, alone
    or two at a time, then with one feature off as well: hidden size = heads * head size
    (an output projection sized hidden x hidden), the head size a latent attention
    derives, the class's own default layer types, a rope per layer type, a rope theta in
    sub-configs the modeling code reads one from, and each feature off in turn (one the
    config class rejects, or that makes the source fail as a decoder)."""
    import itertools

    fixes = []
    heads, hd = values.get("num_attention_heads"), values.get("head_dim", HEAD_DIM)
    if heads and "hidden_size" in values:
        fixes.append(lambda v: v.update(hidden_size=heads * hd))
    if "head_dim" in values and "qk_nope_head_dim" in values:
        fixes.append(lambda v: v.pop("head_dim"))
    if "head_dim" in values:
        # a head size the source's own defaults assume (rope sections sized for 128)
        fixes.append(lambda v: v.update(head_dim=128))
    names = own_fields(config_cls)
    if {"num_heads", "expand", "state_size"} <= set(names) and "hidden_size" in values:
        # a Mamba-2 mixer's heads span its expanded width (Mamba 2 validates it); a
        # small state, one group, an SSD chunk shorter than the verification prompts
        expand = names["expand"][1]
        fixes.append(
            lambda v: v.update(
                num_heads=v["hidden_size"] * expand // v.get("head_dim", HEAD_DIM),
                state_size=SIZES["mamba_d_state"],
                n_groups=1,
                chunk_size=SIZES["mamba_chunk_size"],
            )
        )
    parts = smaller_parts(config_cls, values)
    if parts:
        # sub-configs (an audio or vision tower beside the text model) and
        # vocabulary-sized fields besides the vocabulary (hashed n-gram tables) at
        # tiny sizes: tried only where the tiny text sizes alone do not run small
        fixes.append(lambda v: v.update(json.loads(json.dumps(parts))))
    smaller = _smaller_defaults(config_cls, values)
    if smaller:
        # counts the class's validators hold to its defaults (ZAYA: top-1 routing only)
        fixes.append(lambda v: v.update(smaller))
    layers_field = next(
        (k for k in LAYER_FIELDS if k in values),
        None,
    )
    if layers_field:
        # as many layers as the class's own default (GPT-Neo's attention_types say 24)
        try:
            default_layers = getattr(config_cls(), layers_field)
        except Exception:
            default_layers = None
        if isinstance(default_layers, int) and default_layers != values[layers_field]:
            fixes.append(lambda v: v.update({layers_field: default_layers}))
    if "layer_types" in values:
        try:
            kinds = list(dict.fromkeys(config_cls().layer_types or []))
        except Exception:
            kinds = []

        def default_types(v):
            if kinds:
                v["layer_types"] = [kinds[i % len(kinds)] for i in range(4)]
            else:
                v.pop("layer_types", None)
            v["num_hidden_layers"] = 4

        def rope_per_type(v):
            v["rope_parameters"] = {
                kind: {"rope_type": "default", "rope_theta": 10000.0}
                for kind in dict.fromkeys(v.get("layer_types") or [])
            }

        fixes += [default_types, rope_per_type]
    subs = [
        k for k, v in values.items() if isinstance(v, dict) and k != "rope_parameters"
    ]
    if subs:
        fixes.append(
            lambda v: v.update({k: dict(v[k], rope_theta=10000.0) for k in subs})
        )
    head_field = (getattr(config_cls, "attribute_map", {}) or {}).get("head_dim")
    if head_field in values:
        # the head size under the config's own name, which the class derives, over as
        # many kv heads as heads (Zamba 2's q/k/v adapters each span its whole doubled
        # attention width)
        def derived_heads(v):
            v.pop(head_field)
            if "num_key_value_heads" in v and "num_attention_heads" in v:
                v["num_key_value_heads"] = v["num_attention_heads"]

        fixes.append(derived_heads)
    drops = [
        n for n in feature_values(config_cls) if n in values and n != "layer_types"
    ]
    singles = [((), None)] + [((f,), None) for f in fixes] + [((), d) for d in drops]
    pairs = [(c, None) for c in itertools.combinations(fixes, 2)]
    mixed = [((f,), d) for d in drops for f in fixes]
    for combo, drop in singles + pairs + mixed:
        v = json.loads(json.dumps(values))
        for fix in combo:
            fix(v)
        if drop is not None:
            v.pop(drop, None)
        yield v


def _sizes_of(config_cls, fields: dict) -> dict:
    """`SIZES` under `config_cls`'s own field names, and its other vocabulary-sized
    counts (an int field named for a vocabulary, above the tiny one) at the tiny
    vocabulary."""
    alias = getattr(config_cls, "attribute_map", {}) or {}
    out = {
        alias.get(k, k): v
        for k, v in SIZES.items()
        if isinstance(fields.get(alias.get(k, k)), int)
        and not isinstance(fields[alias.get(k, k)], bool)
    }
    for name, value in fields.items():
        if (
            "vocab" in name
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value > VOCAB
        ):
            out.setdefault(name, VOCAB)
    return out


def smaller_parts(config_cls, values: dict) -> dict:
    """Tiny sizes for what the text sizes leave large: each sub-config (`sub_configs`:
    Phi-4-multimodal's audio and vision towers, BLT's local encoder and decoder) under
    its own field names, and the config's own vocabulary-sized fields besides
    `vocab_size` (BLT's hashed byte n-gram table)."""
    try:
        fields = config_cls().to_dict()
    except Exception:  # noqa: BLE001 - a class whose defaults do not validate
        return {}
    out = {
        k: v
        for k, v in _sizes_of(config_cls, fields).items()
        if k not in values and k != "vocab_size"
    }
    for name, sub_cls in (getattr(config_cls, "sub_configs", None) or {}).items():
        sub = fields.get(name)
        if not isinstance(sub, dict) or not isinstance(sub_cls, type):
            continue
        small = _sizes_of(sub_cls, sub)
        if small:
            out[name] = {**sub, **(values.get(name) or {}), **small}
    return out


def _smaller_defaults(config_cls, values: dict) -> dict:
    """The tiny sizes whose class default is smaller still (a top-k of 1, a single kv
    head), at that default: restoring them never grows the model."""
    try:
        defaults = config_cls().to_dict()
    except Exception:  # noqa: BLE001 - a class whose defaults do not validate
        return {}
    return {
        k: defaults[k]
        for k in SIZES
        if isinstance(values.get(k), int)
        and isinstance(defaults.get(k), int)
        and not isinstance(defaults[k], bool)
        and 0 < defaults[k] < values[k]
    }


def working_values(causal_cls, overrides: dict | None = None) -> dict:
    """The first of `variants` whose model builds and runs a forward in transformers
    (the error of the plain tiny values when none does), with every length at which
    attention changes what it computes inside the verification prompts."""
    from . import grouped_heads, length_regimes

    config_cls = causal_cls.config_class
    plain = tiny_values(config_cls, overrides, source_layer_kinds(causal_cls))
    # kv heads below the heads, where a field holds them at the head count
    grouped = {**plain, **grouped_heads.kv_head_values(causal_cls, plain)}
    first_error = None
    for base in [grouped] if grouped == plain else [grouped, plain]:
        for attempt, values in enumerate(variants(config_cls, base)):
            if attempt >= 120:
                break
            values = {**values, **(overrides or {})}
            try:
                check_runs(causal_cls, values)
            except Exception as exc:  # noqa: BLE001 - the source's own failure
                first_error = first_error or exc
                continue
            return length_regimes.shrink(causal_cls, values, keep=set(overrides or {}))
    raise first_error


def fit_latent_attention(values: dict, fields: dict) -> None:
    """Latent attention expands its latent into one key/value per head: kv heads = heads."""
    if "kv_lora_rank" in fields and "num_attention_heads" in values:
        values["num_key_value_heads"] = values["num_attention_heads"]


def tiny_config(config_cls, overrides: dict | None = None):
    return config_cls(**tiny_values(config_cls, overrides))


def fit_parallel(cfg: dict, tp: int, pp: int) -> list[str]:
    """Make `cfg` divisible for tp x pp ranks (in place); say what changed.

    Heads must split across tensor-parallel ranks, and kv heads must either split too or
    divide the rank count (they are then replicated); every pipeline stage needs a layer.
    """
    notes = []
    heads = cfg.get("num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    if heads and (heads % tp or (kv >= tp and kv % tp) or (kv < tp and tp % kv)):
        factor = tp // math.gcd(kv, tp)
        cfg["num_attention_heads"], cfg["num_key_value_heads"] = (
            heads * factor,
            kv * factor,
        )
        if "head_dim" not in cfg and "hidden_size" in cfg:
            cfg["hidden_size"] = cfg["num_attention_heads"] * HEAD_DIM
        notes.append(
            f"heads {heads}:{kv} -> {heads * factor}:{kv * factor} to divide over {tp} ranks"
        )
    layers = cfg.get("num_hidden_layers", pp)
    if layers < pp:
        cfg["num_hidden_layers"] = pp
        if isinstance(cfg.get("layer_types"), list):
            cfg["layer_types"] = (cfg["layer_types"] * pp)[:pp]
        notes.append(f"layers {layers} -> {pp} for {pp} pipeline stages")
    return notes


def _clamp_token_ids(cfg: dict, vocab: int) -> None:
    for key in TOKEN_IDS:
        value = cfg.get(key)
        if isinstance(value, int) and value >= vocab:
            cfg[key] = vocab - 1
        elif isinstance(value, list):
            cfg[key] = [v if v < vocab else vocab - 1 for v in value]


def _shrunk_layers(cfg: dict) -> int:
    """Fewest layers keeping at least one of every layer type (2 at the least)."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and types:
        kinds = list(dict.fromkeys(types))
        prefix = max(types.index(k) for k in kinds) + 1
        kept = types[:prefix] if prefix <= 8 else kinds
        if len(kept) < 2:
            kept = kept * 2
        cfg["layer_types"] = kept
        return len(kept)
    n = min(cfg.get("num_hidden_layers", 4), 4)
    if cfg.get("use_sliding_window") and "max_window_layers" in cfg:
        cfg["max_window_layers"] = n // 2  # keep both sliding and full layers
    return n


def shrink(raw: dict, overrides: dict | None = None) -> dict:
    """A real checkpoint's config with only its sizes shrunk; every other field (flags,
    values, fields the current config class no longer writes) is kept as published."""
    cfg = json.loads(json.dumps(raw))
    heads = cfg.get("num_attention_heads", 4)
    kv = cfg.get("num_key_value_heads") or heads
    ratio = max(1, heads // kv)
    new_kv = 2 if kv >= 2 and ratio <= 4 else 1
    cfg["num_attention_heads"] = ratio * new_kv
    if "num_key_value_heads" in cfg:
        cfg["num_key_value_heads"] = new_kv
    head_dim = cfg.get("head_dim")
    if head_dim is not None:
        cfg["head_dim"] = (
            head_dim if head_dim in CPU_HEAD_DIMS and head_dim <= 128 else HEAD_DIM
        )
        new_hidden = 256
    else:
        new_hidden = cfg["num_attention_heads"] * HEAD_DIM
    old_hidden = cfg.get("hidden_size", new_hidden)
    cfg["hidden_size"] = new_hidden
    if "intermediate_size" in cfg:
        cfg["intermediate_size"] = max(
            16, round(cfg["intermediate_size"] / old_hidden * new_hidden / 16) * 16
        )
    cfg["num_hidden_layers"] = _shrunk_layers(cfg)
    cfg["vocab_size"] = VOCAB
    _clamp_token_ids(cfg, VOCAB)
    cfg.pop("quantization_config", None)  # random weights are not quantized
    cfg.update(overrides or {})
    return cfg


def features_on(config) -> list[str]:
    """The features switched on in `config` (for the verification report)."""
    on = []
    for name in feature_values(type(config)):
        value = getattr(config, name, None)
        if name == "layer_types":
            if value and len(set(value)) > 1:
                on.append("mixed_layer_types")
        elif value not in (None, False):
            on.append(name if value is True else f"{name}={value}")
    # dense layers among MoE layers
    for name, plain in (
        ("mlp_only_layers", []),
        ("decoder_sparse_step", 1),
        ("first_k_dense_replace", 0),
    ):
        value = getattr(config, name, plain)
        if value not in (plain, None):
            on.append(f"{name}={value}")
    on += _lengths_inside(config)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        on.append(f"rope_type={rope['rope_type']}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        on.append(f"partial_rotary_factor={rope['partial_rotary_factor']}")
    return on


def _lengths_inside(config) -> list[str]:
    """The lengths `length_regimes.shrink` moved inside the prompts (`field=32`)."""
    from .length_regimes import SMALL

    try:
        defaults = type(config)().to_dict()
    except Exception:  # noqa: BLE001 - a config class with required fields
        return []
    out = []
    for key, value in config.to_dict().items():
        default = defaults.get(key)
        if value == SMALL and isinstance(value, int) and default != SMALL:
            out.append(f"{key}={value}")
        elif isinstance(value, dict) and isinstance(default, dict):
            out += [
                f"{key}.{k}={v}"
                for k, v in value.items()
                if v == SMALL and isinstance(v, int) and default.get(k) != SMALL
            ]
    return out


# Checkpoint layouts: "saved" is what `save_pretrained` writes, the published names
# (per-expert MoE tensors, Mixtral's block_sparse_moe.experts.<e>.w1); "in-memory" is
# the model's own state dict (transformers v5 stacks experts into 3-D tensors at load).
LAYOUTS = ("saved", "in-memory")


def build_checkpoint(
    causal_cls,
    config,
    out_dir: Path,
    raw_config: dict | None = None,
    seed: int = 0,
    layout: str = "saved",
    rounded_to: torch.dtype | None = None,
):
    """Save a random-weight fp32 safetensors checkpoint and return the transformers model
    loaded back from it, so the reference reads the same files the engine reads.

    `raw_config` (a shrunk published config) is written as config.json verbatim.
    `rounded_to` (bf16): every weight is a value of that dtype, so an engine loading the
    checkpoint in it holds the very weights the fp32 reference computes with."""
    torch.manual_seed(seed)
    config.architectures = [causal_cls.__name__]
    # the source's experts loop, not transformers' library kernel for it (see probe.build)
    config._experts_implementation = "eager"
    model = causal_cls(config).to(torch.float32).eval()
    randomize(model, seed)
    if rounded_to is not None:
        from fusion_patterns.dataflow import round_weights

        round_weights(model, rounded_to)
    model.save_pretrained(out_dir, safe_serialization=True)
    if layout == "in-memory":
        _save_state_dict(model, out_dir)
    cfg = (
        dict(raw_config)
        if raw_config is not None
        else json.loads((out_dir / "config.json").read_text())
    )
    cfg["architectures"] = [causal_cls.__name__]
    cfg["torch_dtype"] = cfg["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    del model
    reference = causal_cls.from_pretrained(
        out_dir,
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    return reference.eval()


def _save_state_dict(model: torch.nn.Module, out_dir: Path) -> None:
    """Replace the saved weights by the model's own state dict, under its own names."""
    from safetensors.torch import save_file

    for old in out_dir.glob("model*.safetensors*"):
        old.unlink()
    tensors, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if (
            tensor.data_ptr() in seen
        ):  # a tied weight: saved once, as save_pretrained does
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
