"""The faithful attention: the source's attention class with its attention-interface
call handed to vLLM's paged `Attention`.

Everything vLLM's `Attention` must know when it is built (heads, kv heads, head sizes,
the softmax scale, the sliding window, a logit soft-cap, attention sinks) is read from
what every layer actually hands its attention interface in the source's own tiny model,
and written as the source's own expression for it (`self.scaling`, `self.sliding_window`,
`self.head_dim`), checked on every layer. The window is read from the mask each layer
receives, since that is what transformers' eager and sdpa paths attend through.

The proof: vLLM's attention semantics (causal, window, scale, soft-cap, sinks, grouped
kv heads), written out in torch, on the query/key/value each layer passed, must equal
what the source's attention function returned. Anything else the source's attention
function does (a temperature, its own mask) fails it: the model is refused with the
reason, never approximated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, code

from ..errors import BeyondAttention, CodemodError
from ..attention_calls import AttentionCall, interface_call
from .inference import inference_folded

NAME = "attention"
TOLERANCE = 1e-5
# keyword of the interface call -> what it means for vLLM's Attention
WINDOW_KWARGS = ("sliding_window",)
SOFTCAP_KWARGS = ("softcap",)
SINK_KWARGS = ("s_aux", "sinks")
SCALE_KWARGS = ("scaling", "scale", "softmax_scale")
# arguments that change nothing at inference
INERT_KWARGS = {"dropout", "position_ids", "cache_position", "is_causal", "layer_idx"}


@dataclass
class AttentionSpec:
    class_name: str
    heads: str  # expressions, valid at the end of the source's __init__
    kv_heads: str
    head_size: str
    head_size_v: str | None
    scale: str
    window: str | None
    softcap: str | None
    sinks: str | None
    attr: str = "attn"  # the vLLM Attention's attribute on the module
    # int attributes holding head counts, divided by the TP size when sharded
    head_attrs: list[str] = field(default_factory=list)
    kv_head_attrs: list[str] = field(default_factory=list)  # the kv ones among them
    notes: list[str] = field(default_factory=list)
    # a model's own attention core (eager_attention.py) instead of the interface call
    eager: object = None
    key_transposed: bool = False
    out_layout: str = (
        "heads"  # the core's output: [1, heads, tokens, d] or tokens first
    )
    out_dims: int = 4
    container: str | None = None  # the helper method returns a list / tuple
    arity: int = 1
    alibi: str | None = None  # an expression for the ALiBi slopes
    # attention within aligned chunks of this many tokens (Llama 4's local layers):
    # vLLM's ChunkedLocalAttention on the layers where it is not None
    chunk: str | None = None
    # (kv heads the weights hold, kv heads the attention receives): keys and values
    # broadcast to more heads before it, cached as broadcast
    broadcast: tuple[int, int] | None = None

    def describe(self) -> str:
        extra = [
            f"scale={self.scale}",
            *([f"window={self.window}"] if self.window else []),
            *([f"chunk={self.chunk}"] if self.chunk else []),
            *([f"soft-cap={self.softcap}"] if self.softcap else []),
            *([f"sinks={self.sinks}"] if self.sinks else []),
            *([f"alibi={self.alibi}"] if self.alibi else []),
        ]
        what = "its own attention core" if self.eager else "attention interface"
        line = f"{what} -> vLLM Attention ({', '.join(extra)})"
        if self.broadcast:
            held, handed = self.broadcast
            line += (
                f"; its keys and values are broadcast from {held} to {handed} heads "
                f"before it and cached as broadcast ({handed // held}x the KV cache "
                "of the grouped layout)"
            )
        return line


def _atom(expr: str) -> str:
    """`expr`, parenthesized unless it is a name or attribute."""
    return expr if expr.replace(".", "").replace("_", "").isalnum() else f"({expr})"


def _evaluate(text: str, env: dict):
    try:
        return eval(text, dict(env))  # noqa: S307 - source expressions, trusted
    except Exception:
        return _FAILED


_FAILED = object()


def _env(call: AttentionCall, config, config_param: str | None, pymodule) -> dict:
    env = dict(vars(pymodule)) if pymodule is not None else {}
    # the local variables its __init__ ended with (probe.init_locals)
    env.update(getattr(call.module, "_codemods_init_locals", {}) or {})
    env["self"] = call.module
    if config_param:
        env[config_param] = config
    return env


def _config_param(info: ClassInfo) -> str | None:
    if info.init is None:
        return None
    names = [p.name.value for p in info.init.params.params]
    return "config" if "config" in names else None


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    except (TypeError, ValueError):
        return False


def _expression_for(
    candidates: list[str],
    expected: list,
    envs: list[dict],
) -> str | None:
    """The first candidate expression that evaluates to the expected value on every layer."""
    for text in candidates:
        ok = True
        for want, env in zip(expected, envs):
            got = _evaluate(text, env)
            if got is _FAILED or not _same(got, want):
                ok = False
                break
        if ok:
            return text
    return None


# name preferences, most specific first
_HEAD_NAMES = ("num_heads", "num_attention_heads", "n_head", "n_heads", "heads")
_KV_NAMES = (
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "num_key_value_head",
    "kv_heads",
)
_SIZE_NAMES = ("head_dim", "head_size", "attention_head_size", "head_dim_qk")


def _int_candidates(info: ClassInfo, instance, config_param, preferred) -> list[str]:
    attrs = [
        a
        for a in info.attrs
        if isinstance(getattr(instance, a, None), int)
        and not isinstance(getattr(instance, a, None), bool)
    ]

    def rank(name: str) -> tuple:
        for i, want in enumerate(preferred):
            if name == want:
                return (0, i)
        for i, want in enumerate(preferred):
            if want in name:
                return (1, i)
        return (2, 0)

    out = [f"self.{a}" for a in sorted(attrs, key=rank) if rank(a)[0] < 2]
    local = getattr(instance, "_codemods_init_locals", {}) or {}
    out += [
        n
        for n in sorted(local, key=rank)
        if rank(n)[0] < 2
        and isinstance(local[n], int)
        and not isinstance(local[n], bool)
        and n != "self"
    ]
    if config_param:
        out += [f"{config_param}.{n}" for n in preferred]
    return out + _forward_counts(info, rank)


def _forward_counts(info: ClassInfo, rank) -> list[str]:
    """The call-free expressions the forward assigns to a count's name (Falcon's
    `num_kv_heads = self.num_heads if self.new_decoder_architecture else
    self.num_kv_heads`): the source's own word for what it hands its attention, on
    every branch, where an attribute of that name says something else."""
    if info.forward is None:
        return []
    found = []
    for assign in m.findall(info.forward, m.Assign(targets=[m.AssignTarget(m.Name())])):
        name = assign.targets[0].target.value
        if rank(name)[0] < 2 and not m.findall(assign.value, m.Call()):
            found.append((rank(name), code(assign.value)))
    return [text for _, text in sorted(found, key=lambda f: f[0])]


def window_of(mask, tokens: int) -> int | None | object:
    """The sliding window a mask encodes: None for plain causal, the window size, or
    _FAILED for a mask that is neither (bidirectional, chunked, padded)."""
    kind, size = mask_kind(mask, tokens)
    return size if kind in ("causal", "window") else _FAILED


def mask_kind(mask, tokens: int) -> tuple[str, int | None]:
    """What a mask encodes: ("causal", None), ("window", w) (each query sees its last w
    tokens), ("chunk", c) (causal within aligned chunks of c tokens), or ("other", None).
    """
    import torch

    if mask is None:
        return "other", None
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask > torch.finfo(mask.dtype).min / 2
    allowed = allowed.reshape(-1, *allowed.shape[-2:])[0]
    q_len, k_len = allowed.shape
    if q_len != tokens or k_len < tokens:
        return "other", None
    allowed = allowed[:, k_len - tokens :]
    i = torch.arange(tokens)[:, None]
    j = torch.arange(tokens)[None, :]
    causal = j <= i
    if torch.equal(allowed, causal):
        return "causal", None
    for w in range(1, tokens):
        if torch.equal(allowed, causal & (i - j < w)):
            return "window", w
    for c in range(1, tokens):
        if torch.equal(allowed, causal & (i // c == j // c)):
            return "chunk", c
    return "other", None


def per_layer_candidates(
    info: ClassInfo, config, config_param: str | None, words: tuple[str, ...]
) -> list[str]:
    """Expressions for a per-layer length the source applies only through the masks its
    model builds by layer type: `self.<x>`, `config.<field>`, and `(config.<field> if
    config.<types>[<layer index>] == "<type>" else None)` for each per-layer type list
    (Llama 4's chunks on its "chunked_attention" layers)."""
    fields = [
        k for k in vars(config) if any(w in k for w in words) and not k.startswith("_")
    ]
    cfg = config_param or "self.config"
    out = [f"self.{a}" for a in info.attrs if any(w in a for w in words)]
    out += [f"{cfg}.{k}" for k in fields]
    n = getattr(config, "num_hidden_layers", None)
    lists = [
        k
        for k, v in vars(config).items()
        if isinstance(v, list) and len(v) == n and all(isinstance(x, str) for x in v)
    ]
    for k in fields:
        for t in lists:
            for kind in dict.fromkeys(getattr(config, t)):
                for idx in ("self.layer_idx", "layer_idx", "self.layer_id", "layer_id"):
                    out.append(f'({cfg}.{k} if {cfg}.{t}[{idx}] == "{kind}" else None)')
    return out


def reference(query, key, value, scale, window, softcap, sinks, alibi=None, chunk=None):
    """What vLLM's `Attention` computes, written out: [1, H, S, D] -> [S, H * Dv]."""
    import torch

    q, k, v = query[0].float(), key[0].float(), value[0].float()
    heads, tokens = q.shape[0], q.shape[1]
    group = heads // k.shape[0]
    k = k.repeat_interleave(group, dim=0)
    v = v.repeat_interleave(group, dim=0)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    i = torch.arange(tokens)[:, None]
    j = torch.arange(tokens)[None, :]
    if alibi is not None:  # vLLM adds slope * (key position - query position)
        slopes = torch.as_tensor(alibi, dtype=torch.float32).reshape(heads, 1, 1)
        logits = logits + slopes * (j - i)
    allowed = j <= i
    if window:
        allowed = allowed & (i - j < window)
    if chunk:
        allowed = allowed & (i // chunk == j // chunk)
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(heads, 1, 1).expand(heads, tokens, 1)
        logits = torch.cat([logits, sink], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(logits, dim=-1)
    out = torch.matmul(probs, v)  # [H, S, Dv]
    return out.transpose(0, 1).reshape(tokens, -1)


def _kwarg_exprs(call: cst.Call) -> dict[str, str]:
    return {a.keyword.value: code(a.value) for a in call.args if a.keyword is not None}


def _mask_name(call: cst.Call) -> str | None:
    """The variable handed to the attention interface as its mask (the fifth argument:
    module, query, key, value, mask), if it is a plain name."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == "attention_mask":
            return arg.value.value if isinstance(arg.value, cst.Name) else None
    positional = [a for a in call.args if a.keyword is None and not a.star]
    if len(positional) > 4 and isinstance(positional[4].value, cst.Name):
        return positional[4].value.value
    return None


def _assigned(forward: cst.FunctionDef, name: str) -> bool:
    target = m.Name(name)
    return bool(
        m.findall(forward, m.AssignTarget(target=target))
        or m.findall(forward, m.AugAssign(target=target))
        or m.findall(forward, m.AnnAssign(target=target))
    )


def infer(
    info: ClassInfo, calls: list[AttentionCall], config, pymodule
) -> AttentionSpec:
    """Read the vLLM Attention arguments of one attention class from its layers' calls,
    as expressions of the source, and prove vLLM's semantics equal the source's."""
    call_node = _checked_call(info, calls)
    kw_exprs = _kwarg_exprs(call_node)
    config_param = _config_param(info)
    envs = [_env(c, config, config_param, pymodule) for c in calls]
    tokens = calls[0].query.shape[2]
    sizes = _sizes(info, calls, envs, config_param)
    scale_expr, scales = _scale(info, calls, kw_exprs, envs, sizes)
    window_expr, windows, chunk_expr, chunks = _window_and_chunk(
        info, calls, kw_exprs, envs, config, config_param, tokens
    )
    softcap_expr, softcaps = _softcap(info, calls, kw_exprs, envs)
    sinks_expr, sinks = _sinks(info, calls, kw_exprs)
    notes = _other_kwargs(calls)
    _prove(calls, scales, windows, softcaps, sinks, chunks, tokens)
    heads_expr, kv_expr, size_expr, size_v_expr = sizes
    q_attrs, kv_attrs = head_count_attrs(
        info,
        calls[0].module,
        heads_expr,
        kv_expr,
        calls[0].query.shape[1],
        calls[0].key.shape[1],
    )
    attr = "attn" if "attn" not in info.attrs else "vllm_attn"
    broadcast = broadcast_from(
        info, calls[0].module, envs[0], config_param, calls[0].key.shape[1]
    )
    return AttentionSpec(
        class_name=info.name,
        heads=heads_expr,
        kv_heads=kv_expr,
        head_size=size_expr,
        head_size_v=size_v_expr,
        scale=scale_expr,
        window=window_expr,
        chunk=chunk_expr,
        softcap=softcap_expr,
        sinks=sinks_expr,
        attr=attr,
        head_attrs=q_attrs + kv_attrs,
        kv_head_attrs=kv_attrs,
        notes=notes,
        broadcast=broadcast,
    )


def _checked_call(info: ClassInfo, calls: list[AttentionCall]) -> cst.Call:
    """The interface call of `info`'s forward, once it is known vLLM can take it: the
    mask is not computed from the data, every tensor is [batch, heads, tokens, size]."""
    if not calls:
        raise CodemodError(
            f"cannot generate: the tiny model never calls {info.name}'s attention"
        )
    call_node = interface_call(info.forward)
    if call_node is None:
        raise CodemodError(
            f"cannot generate: {info.name}.forward does not call its attention interface once"
        )
    # on the path that runs under vLLM (GPT-2's cross-attention branch rebinds its mask)
    try:
        folded = inference_folded(info.forward)
    except Exception:  # the copy stage reports what cannot be folded; check as written
        folded = info.forward
    folded_call = interface_call(folded)
    mask = _mask_name(folded_call) if folded_call is not None else None
    if mask is not None and _assigned(folded, mask):
        raise BeyondAttention(
            f"{info.name}.forward computes the mask it attends through "
            f"(`{mask} = ...`, a mask that depends on the data, such as a sparse top-k "
            "index), which vLLM's Attention cannot take"
        )
    for c in calls:
        for name, t in (("query", c.query), ("key", c.key), ("value", c.value)):
            if t.dim() != 4 or t.shape[0] != 1:
                raise CodemodError(
                    f"cannot generate: {info.name} hands its attention a {name} shaped "
                    f"{list(t.shape)}, not [batch, heads, tokens, head size]"
                )
    return call_node


def _sizes(info: ClassInfo, calls, envs, config_param):
    """(heads, kv heads, head size, value head size or None) as source expressions."""
    heads = [c.query.shape[1] for c in calls]
    kv = [c.key.shape[1] for c in calls]
    size = [c.query.shape[3] for c in calls]
    size_v = [c.value.shape[3] for c in calls]
    if any(h % k for h, k in zip(heads, kv)):
        raise CodemodError(
            f"cannot generate: {info.name}: {heads[0]} query heads over {kv[0]} kv heads"
        )
    for c in calls:
        if c.key.shape[3] != c.query.shape[3] or c.value.shape[1] != c.key.shape[1]:
            raise CodemodError(
                f"cannot generate: {info.name}: key {list(c.key.shape)} / value "
                f"{list(c.value.shape)} do not pair with query {list(c.query.shape)}"
            )
    inst = calls[0].module
    heads_expr = _expression_for(
        _int_candidates(info, inst, config_param, _HEAD_NAMES), heads, envs
    )
    kv_expr = kv_heads_expression(info, inst, config_param, heads_expr, heads, kv, envs)
    size_expr = _expression_for(
        _int_candidates(info, inst, config_param, _SIZE_NAMES), size, envs
    )
    size_v_expr = None
    if size_v != size:
        size_v_expr = _expression_for(
            _int_candidates(info, inst, config_param, ("v_head_dim", "head_dim_v")),
            size_v,
            envs,
        )
        if size_v_expr is None:
            raise CodemodError(
                f"cannot generate: {info.name}: no attribute holds the value head size {size_v[0]}"
            )
    for what, expr, value in (
        ("head count", heads_expr, heads[0]),
        ("kv head count", kv_expr, kv[0]),
        ("head size", size_expr, size[0]),
    ):
        if expr is None:
            raise CodemodError(
                f"cannot generate: {info.name}: no attribute or config field holds its {what} ({value})"
            )
    return heads_expr, kv_expr, size_expr, size_v_expr


def _scale(info: ClassInfo, calls, kw_exprs, envs, sizes):
    """The scale: the argument the source passes, else the default 1/sqrt(head size)."""
    import torch

    first = calls[0]
    size_expr = sizes[2]
    scale_kw = next((k for k in SCALE_KWARGS if k in first.kwargs), None)
    scales = [c.kwargs.get(scale_kw) if scale_kw else None for c in calls]
    if scale_kw is None or all(s is None for s in scales):
        return f"{_atom(size_expr)} ** -0.5", [c.query.shape[3] ** -0.5 for c in calls]
    if any(isinstance(s, torch.Tensor) for s in scales):
        raise CodemodError(
            f"cannot generate: {info.name} passes a tensor as its attention scale"
        )
    src = kw_exprs.get(scale_kw)
    scale_expr = _expression_for([src], scales, envs) if src is not None else None
    if scale_expr is None:
        scale_expr = _expression_for(
            [f"self.{a}" for a in info.attrs if "scal" in a], scales, envs
        )
    if scale_expr is None:
        raise CodemodError(
            f"cannot generate: {info.name}'s attention scale `{src}` is not an attribute set in __init__"
        )
    return scale_expr, scales


def _window_and_chunk(info, calls, kw_exprs, envs, config, config_param, tokens):
    """The window and the chunk: what the mask each layer receives encodes, checked
    against the window the source hands its attention function."""
    kinds = [mask_kind(c.mask, tokens) for c in calls]
    for c, (kind, _) in zip(calls, kinds):
        if kind == "other":
            raise CodemodError(
                f"cannot generate: {c.path} receives an attention mask that is neither "
                "causal, a causal sliding window nor causal chunks"
            )
    windows = [w if k == "window" else None for k, w in kinds]
    chunks = [w if k == "chunk" else None for k, w in kinds]
    window_expr = _window_argument(info, kw_exprs, windows, envs, tokens)
    if window_expr is None and any(w is not None for w in windows):
        window_expr = _expression_for(
            per_layer_candidates(info, config, config_param, ("window",)), windows, envs
        )
        if window_expr is None:
            raise CodemodError(
                f"cannot generate: {info.name} attends through sliding windows "
                f"{sorted({w for w in windows if w})} but no argument or attribute holds them"
            )
    if window_expr is not None:  # the source's own values (a window past the probe too)
        windows = [_evaluate(window_expr, env) for env in envs]
    chunk_expr = None
    if any(c is not None for c in chunks):
        chunk_expr = _expression_for(
            per_layer_candidates(info, config, config_param, ("chunk",)), chunks, envs
        )
        if chunk_expr is None:
            raise CodemodError(
                f"cannot generate: {info.name} attends within chunks of "
                f"{sorted({c for c in chunks if c})} tokens but no attribute or config "
                "field holds them"
            )
    return window_expr, windows, chunk_expr, chunks


def _softcap(info, calls, kw_exprs, envs):
    first = calls[0]
    soft_kw = next((k for k in SOFTCAP_KWARGS if k in first.kwargs), None)
    if soft_kw is None or not any(c.kwargs.get(soft_kw) for c in calls):
        return None, [None] * len(calls)
    softcaps = [c.kwargs.get(soft_kw) for c in calls]
    src = kw_exprs.get(soft_kw)
    softcap_expr = _expression_for([src] if src else [], softcaps, envs)
    if softcap_expr is None:
        raise CodemodError(
            f"cannot generate: {info.name}'s attention soft-cap `{src}` is not an attribute set in __init__"
        )
    return softcap_expr, softcaps


def _sinks(info, calls, kw_exprs):
    first = calls[0]
    sink_kw = next((k for k in SINK_KWARGS if k in first.kwargs), None)
    if sink_kw is None or all(c.kwargs.get(sink_kw) is None for c in calls):
        return None, [None] * len(calls)
    src = kw_exprs.get(sink_kw)
    if src is None or not m.matches(
        cst.parse_expression(src), m.Attribute(value=m.Name("self"))
    ):
        raise CodemodError(
            f"cannot generate: {info.name}'s attention sinks are not one parameter of the module"
        )
    return src, [c.kwargs.get(sink_kw) for c in calls]


def _other_kwargs(calls) -> list[str]:
    """What else the call hands over: a tensor is data vLLM's Attention never sees (a
    refusal); anything else is noted as ignored."""
    import torch

    first = calls[0]
    unknown = set(first.kwargs) - INERT_KWARGS - set(SCALE_KWARGS) - set(WINDOW_KWARGS)
    unknown -= set(SOFTCAP_KWARGS) | set(SINK_KWARGS)
    for c in calls:
        data = sorted(k for k in unknown if isinstance(c.kwargs.get(k), torch.Tensor))
        if data:
            raise BeyondAttention(
                f"{c.path} hands its attention "
                + ", ".join(f"`{k}=` (a tensor)" for k in data)
                + ", which vLLM's Attention cannot take (a sparse top-k index, say)"
            )
    return [
        f"`{k}=` ignored" for k in sorted(unknown) if first.kwargs.get(k) is not None
    ]


def _prove(calls, scales, windows, softcaps, sinks, chunks, tokens) -> None:
    """vLLM's semantics on the tensors each layer passed, against its result."""
    for c, chunk, window, cap, sink in zip(calls, chunks, windows, softcaps, sinks):
        if chunk and (window or cap or sink is not None):
            raise CodemodError(
                f"cannot generate: {c.path} attends within chunks and also has a window, "
                "a soft-cap or sinks, which vLLM's ChunkedLocalAttention does not take"
            )
    for c, scale, window, cap, sink, chunk in zip(
        calls, scales, windows, softcaps, sinks, chunks
    ):
        ours = reference(c.query, c.key, c.value, scale, window, cap, sink, chunk=chunk)
        theirs = c.output
        if theirs.dim() == 4:
            theirs = theirs[0].reshape(tokens, -1)
        else:
            theirs = theirs.reshape(tokens, -1)
        if theirs.shape != ours.shape:
            raise CodemodError(
                f"cannot generate: {c.path}'s attention returns {list(c.output.shape)}, "
                "not [batch, tokens, heads, head size]"
            )
        err = (ours - theirs.float()).abs().max().item()
        ref = theirs.float().abs().max().item() or 1.0
        if err / ref > TOLERANCE:
            raise CodemodError(
                f"cannot generate: {c.path}: vLLM's attention (scale {scale:.4g}, "
                f"window {window}, soft-cap {cap}) differs from the source's attention "
                f"function by {err / ref:.2e} (relative)"
            )


def _window_argument(info, kw_exprs, windows, envs, tokens) -> str | None:
    """The window argument the source hands its attention function (`sliding_window=
    self.sliding_window`), where it holds a window on some layer and agrees with every
    layer's mask: the same window where the mask shows one, a window of at least the
    probe's length (or none) where the mask is plainly causal. The masks are what the
    source computes through; an argument they contradict is not used."""
    for key in WINDOW_KWARGS:
        text = kw_exprs.get(key)
        if text is None:
            continue
        values = [_evaluate(text, env) for env in envs]
        if any(
            v is _FAILED or not (v is None or (isinstance(v, int) and v > 0))
            for v in values
        ) or all(v is None for v in values):
            continue
        agrees = all(
            (seen is not None and v == seen)
            or (seen is None and (v is None or v >= tokens))
            for v, seen in zip(values, windows)
        )
        if agrees:
            return text
    return None


def kv_heads_expression(info, inst, config_param, heads_expr, heads, kv, envs):
    """The source's expression for the kv heads its attention receives on every
    layer, or the head count where they are as many and nothing counts them apart
    (JetMoE's keys tiled to every head: the report says what that costs)."""
    found = _expression_for(
        _int_candidates(info, inst, config_param, _KV_NAMES), kv, envs
    )
    if found is None and heads == kv:
        return heads_expr
    return found


def broadcast_from(info: ClassInfo, inst, env: dict, config_param, kv: int):
    """(kv heads the weights hold, `kv`) where a kv-head attribute or config field
    counts fewer heads than the attention receives (Falcon's new decoder architecture
    broadcasts its grouped keys to every query head), else None."""
    held = [
        got
        for text in _int_candidates(info, inst, config_param, _KV_NAMES)
        if type(got := _evaluate(text, env)) is int and 0 < got < kv and kv % got == 0
    ]
    return (min(held), kv) if held else None


def head_count_attrs(info, inst, heads_expr, kv_expr, heads: int, kv: int):
    """(attributes holding the query head count, the kv head count): the ones the
    source's reshapes may count heads with, fitted to a rank's share under TP."""
    q_attrs, kv_attrs = [], []
    for a in info.attrs:
        value = getattr(inst, a, None)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        named = "head" in a and not any(s in a for s in ("dim", "size"))
        if f"self.{a}" == kv_expr and kv != heads:
            kv_attrs.append(a)
        elif f"self.{a}" == heads_expr or (named and value == heads):
            q_attrs.append(a)
        elif named and value == kv:
            kv_attrs.append(a)
    return q_attrs, kv_attrs
