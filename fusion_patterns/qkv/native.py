"""A whole attention class -> vLLM's own layout: `QKVParallelLinear`, vLLM's rope
(`get_rope`), the paged `Attention`, a row-parallel output projection.

Claimed where every part is proven on every layer of the tiny model: the q/k/v match
(`match.py`), the dataflow, and the numbers of what this class computes (merged GEMM,
split, head norms, vLLM's rope for the source's rotary code and rope parameters) against
what the source hands its attention call; the attention call itself is the copy
stage's proven vLLM `Attention` (scale, window, soft-cap; no sinks, ALiBi or chunks).
Its callers hand it vLLM's positions: `self.self_attn(positions, hidden_states)`.
Where this fails, the class is copied and `merge.py` may still merge its projections.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from ..base import CLASS, Claim, ClassInfo, Pattern, PatternRefused, Refusal, code
from ..emitting import (
    indent,
    positions_call,
    returned_arity,
    signature,
    source_params,
    translate_init,
)
from ..rms_norm import is_norm_call
from ..rotary.match import condition as rope_condition
from . import proof
from .match import NAME, QKVSpec, match, records

WHAT = "attention"
# torch.cat((-x2, x1), dim=-1): rotate_half over the two halves (GPT-NeoX style rotary)
NEOX_ROTATE = m.Call(
    func=m.Attribute(value=m.Name("torch"), attr=m.Name("cat")),
    args=[
        m.Arg(
            m.Tuple(
                [m.Element(m.UnaryOperation(operator=m.Minus())), m.Element(m.Name())]
            )
        ),
        m.ZeroOrMore(),
    ],
)
# config.rope_parameters[layer_type]: one rope per kind of layer (Gemma 3); an index by a
# name, not a string key such as ["rope_theta"]
ROPE_BY_LAYER_TYPE = m.Subscript(
    value=m.Attribute(attr=m.Name("rope_parameters")),
    slice=[m.SubscriptElement(m.Index(m.Name()))],
)
# A norm over the whole q or k projection (OLMo 2): each rank holds some heads, so the
# projection is gathered, normed whole and split again, as vLLM's olmo2.py does.
WHOLE_PROJECTION_NORM = """
    def _whole_projection_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return norm(x)
        x = norm(tensor_model_parallel_all_gather(x.contiguous()))
        return split_tensor_along_last_dim(x, self.tp_size)[self.tp_rank].contiguous()
"""


class NativeAttention(Pattern):
    name = "attention"

    def claim(self, model):
        neox = bool(m.findall(model.source.module, NEOX_ROTATE))
        by_type = bool(m.findall(model.source.module, ROPE_BY_LAYER_TYPE))
        norms = model.norm_specs()
        for n, attention in model.roles.attention.items():
            info = model.classes[n]
            spec = match(info, model.norm_classes())
            if not isinstance(spec, QKVSpec):
                continue  # the merge pattern reports the refusal
            try:
                _eligible(attention)
                if (test := rope_condition(info.forward)) is not None:
                    raise PatternRefused(
                        f"its rope is applied only `if {test}` (a layer or config "
                        "without rope hands no tables)"
                    )
                text = emit(info, spec, attention, norms, neox, by_type)
                for path, inst in model.probe.instances.get(n, []):
                    call = model.call(inst)
                    if call is None:
                        raise PatternRefused(f"the tiny model never calls {path}")
                    args, kwargs, _ = call
                    kwargs = {**kwargs, **({"hidden_states": args[0]} if args else {})}
                    rope = model.config.rope_parameters
                    if by_type:
                        rope = rope[model.config.layer_types[_layer_index(path)]]
                    proof.prove(
                        spec, inst, kwargs, model.config, rope, neox, set(norms)
                    )
            except PatternRefused as why:
                yield Refusal(NAME, n, WHAT, f"not vLLM's own layout: {why}")
                continue
            except Exception as exc:  # a proof that cannot run is a refusal
                text = str(exc).splitlines()[0] if str(exc) else ""
                yield Refusal(
                    NAME, n, WHAT, f"proof failed to run: {type(exc).__name__}: {text}"
                )
                continue
            yield Claim(
                self,
                n,
                (spec, text, returned_arity(info)),
                CLASS,
                records=[
                    records(spec, scope, set())[0]
                    for scope in model.roles.scopes.get(n, [""])
                ],
                needs_positions=True,
            )

    def emit_class(self, claim: Claim, info: ClassInfo) -> str:
        return claim.spec[1]

    def call_site(self, claim: Claim, call: cst.Call) -> cst.BaseExpression:
        return positions_call(call, claim.spec[2])

    def loader(self, claim: Claim):
        spec = claim.spec[0]
        if not spec.interleaved:
            return None
        from ..base import LoaderHook

        return LoaderHook(
            INTERLEAVED_LAYOUT.format(key=f".{spec.merged}."),
            "self._checkpoint_layout({weights})",
        )


# A projection packed per head in the checkpoint ([q_h; k_h; v_h] for each head h):
# reordered to [q; k; v], the layout QKVParallelLinear's loader splits into shards.
INTERLEAVED_LAYOUT = """
    def _checkpoint_layout(self, weights):
        for name, tensor in weights:
            if "{key}" in f".{{name}}":
                try:
                    heads = self.get_submodule(name.rsplit(".", 1)[0]).total_num_heads
                except AttributeError:  # a layer of another pipeline stage
                    heads = None
                if heads is not None:
                    tensor = (
                        tensor.view(heads, 3, -1, *tensor.shape[1:])
                        .transpose(0, 1)
                        .reshape(tensor.shape)
                    )
            yield name, tensor
"""


def _eligible(attention) -> None:
    """What vLLM's plain `Attention` in the native layout cannot take."""
    for what, value in (
        ("attention sinks", attention.sinks),
        ("ALiBi slopes", attention.alibi),
        ("attention within chunks", attention.chunk),
        ("a value head of another size", attention.head_size_v),
        ("its own attention core", attention.eager),
    ):
        if value:
            raise PatternRefused(f"{what}")


def _layer_index(path: str) -> int:
    numbers = [int(p) for p in path.split(".") if p.isdigit()]
    if not numbers:
        raise PatternRefused(f"{path} is in no numbered layer")
    return numbers[0]


def _qkv_block(spec: QKVSpec) -> list[str]:
    hd = f"self.{spec.head_dim_attr}"
    q, k, v = spec.projections
    fused = (
        f"# {spec.merged}: packed [q; k; v] in the checkpoint, split by the weight loader."
        if spec.packed
        else f"# Fused: {q} + {k} + {v} -> {spec.merged}."
    )
    return [
        f"{fused} Each rank holds its own heads of q, k",
        "# and v; with fewer kv heads than ranks, k and v are replicated.",
        "tp_size = get_tensor_model_parallel_world_size()",
        f"self.total_num_heads = {code(spec.num_heads)}",
        f"self.total_num_kv_heads = {code(spec.num_kv_heads)}",
        "assert self.total_num_heads % tp_size == 0",
        "if self.total_num_kv_heads >= tp_size:",
        "    assert self.total_num_kv_heads % tp_size == 0",
        "else:",
        "    assert tp_size % self.total_num_kv_heads == 0",
        "self.num_heads = self.total_num_heads // tp_size",
        "self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)",
        f"self.q_size = self.num_heads * {hd}",
        f"self.kv_size = self.num_kv_heads * {hd}",
        f"self.{spec.merged} = QKVParallelLinear({code(spec.hidden_size)}, {hd}, self.total_num_heads, "
        f'self.total_num_kv_heads, bias={code(spec.bias)}, quant_config=quant_config, prefix=f"{{prefix}}.{spec.merged}")',
    ]


# what the merged block sets to this rank's share -> the whole it keeps
_WHOLE = {"num_heads": "total_num_heads", "num_kv_heads": "total_num_kv_heads"}


def _whole_heads(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`expr` reading the whole head counts: vLLM's row-parallel linear takes the whole
    input width, and after the merged block `self.num_heads` is this rank's (Nemotron's
    `RowParallelLinear(self.head_dim * self.num_heads, ...)`, a quarter of its width at
    TP=2, was a heap overrun)."""

    class _Whole(cst.CSTTransformer):
        def leave_Attribute(self, original, updated):
            if (
                isinstance(updated.value, cst.Name)
                and updated.value.value == "self"
                and updated.attr.value in _WHOLE
            ):
                return updated.with_changes(attr=cst.Name(_WHOLE[updated.attr.value]))
            return updated

    return expr.visit(_Whole())


def _attention_lines(attention) -> list[str]:
    """vLLM's `Attention` with what the copy stage proved the source attends with (the
    window exactly as the source passes it; where it passes none, vLLM's model-level
    window is switched off for this layer)."""
    args = [
        "self.num_heads",
        attention.head_size,
        attention.scale,
        "num_kv_heads=self.num_kv_heads",
        "cache_config=cache_config",
        "quant_config=quant_config",
    ]
    if attention.softcap:
        args.append(f"logits_soft_cap={attention.softcap}")
    args += ["per_layer_sliding_window=sliding_window", 'prefix=f"{prefix}.attn"']
    return [
        "cache_config = get_current_vllm_config().cache_config",
        f"sliding_window = {attention.window or 'None'}",
        "if sliding_window is None and cache_config is not None and cache_config.sliding_window:",
        "    # the source attends fully here: keep vLLM from applying the model-level window",
        "    cache_config = shallow_copy(cache_config)",
        "    cache_config.sliding_window = None",
        f"self.attn = Attention({', '.join(args)})",
    ]


def emit(
    info: ClassInfo, spec: QKVSpec, attention, norms, neox: bool, by_type: bool
) -> str:
    q, k, v = spec.projections
    params = source_params(info)
    if "config" not in [p.split("=")[0] for p in params]:
        raise PatternRefused(f"{info.name}.__init__ takes no `config`")

    merged = False

    def translate(attr: str, value: cst.BaseExpression) -> list[str] | None:
        nonlocal merged
        if attr == q:
            merged = True
            return _qkv_block(spec)
        if attr in (k, v):
            return []
        if attr == spec.out_proj:
            in_size, out_size, bias = spec.out_args
            if merged:  # the block above made the head counts this rank's
                in_size = _whole_heads(in_size)
            return [
                f"self.{attr} = RowParallelLinear({code(in_size)}, {code(out_size)}, bias={code(bias)}, "
                f'quant_config=quant_config, prefix=f"{{prefix}}.{attr}")'
            ]
        if norm := is_norm_call(value, norms):
            return [f"self.{attr} = {norm.construction(value)}"]
        return None

    body = translate_init(info, translate)
    hd = f"self.{spec.head_dim_attr}"
    rope = "config.rope_parameters"
    if by_type:
        if "layer_idx" not in [p.split("=")[0] for p in params]:
            raise PatternRefused(
                f"rope differs by layer type but {info.name}.__init__ takes no layer_idx"
            )
        rope = "config.rope_parameters[config.layer_types[layer_idx]]"
    body += [
        f"self.rotary_emb = get_rope({hd}, max_position=config.max_position_embeddings, "
        f"is_neox_style={neox}, rope_parameters={rope})",
        *_attention_lines(attention),
    ]

    fwd = [
        "# vLLM's layout: one row per token",
        "shape = hidden_states.shape",
        "hidden_states = hidden_states.reshape(-1, shape[-1])",
        f"qkv, _ = self.{spec.merged}(hidden_states)",
        "q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)",
    ]
    if any(n is not None and n.per_head for n in (spec.q_norm, spec.k_norm)):
        fwd.append("# q/k norms per head, as the source applies them")
    for norm, var, heads in (
        (spec.q_norm, "q", "self.num_heads"),
        (spec.k_norm, "k", "self.num_kv_heads"),
    ):
        if norm is None:
            continue
        if norm.per_head:
            fwd.append(
                f"{var} = self.{norm.attr}({var}.view(-1, {heads}, {hd})).view({var}.shape)"
            )
        else:
            fwd.append(f"{var} = self._whole_projection_norm(self.{norm.attr}, {var})")
    methods = ""
    if any(n is not None and not n.per_head for n in (spec.q_norm, spec.k_norm)):
        body += [
            "self.tp_rank = get_tensor_model_parallel_rank()",
            "self.tp_size = tp_size",
            "# a norm over the whole k projection needs each rank's own kv heads",
            "assert tp_size == 1 or self.total_num_kv_heads % tp_size == 0",
        ]
        methods = WHOLE_PROJECTION_NORM
    fwd += [
        "q, k = self.rotary_emb(positions, q, k)",
        "attn_output = self.attn(q, k, v)",
        f"output, _ = self.{spec.out_proj}(attn_output)",
        "return output.view(*shape[:-1], -1)",
    ]
    return f"""
class {info.name}(nn.Module):
    def __init__({signature(info)}) -> None:
{indent(body)}

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
{indent(fwd)}
{methods}"""
