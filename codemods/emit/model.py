"""The decoder layer (fused residual + norm), the base model (pipeline parallel) and the
causal LM (head, logits, weight loading), laid out as vLLM's native files are."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import code, linear_args
from fusion_patterns.mla import MLASpec

from ..errors import CodemodError
from ..plan import ModelPlan
from .common import (
    ATTENTION_EXTRAS,
    LAYER_EXTRAS,
    MLP_EXTRAS,
    indent,
    norm_construction,
    signature,
    translate_init,
    with_extras,
)


def emit_layer(plan: ModelPlan) -> str:
    s = plan.structure
    layer = s.layer
    extras = {s.attn_attr: ATTENTION_EXTRAS, s.mlp_attr: MLP_EXTRAS}
    params = [p.name.value for p in layer.init.params.params if p.name.value != "self"]
    unknown = set(params) - {"config", "layer_idx"}
    if unknown:
        raise CodemodError(
            f"cannot generate: {layer.name}.__init__ takes {sorted(unknown)}, not emitted yet"
        )

    def translate(attr: str, value: cst.BaseExpression) -> list[str] | None:
        if attr in extras:
            return [f"self.{attr} = {with_extras(value, extras[attr], attr)}"]
        if norm := s.norms.get(layer.constructed_class(attr) or ""):
            return [f"self.{attr} = {norm_construction(norm, value)}"]
        return None

    prologue = (
        ("layer_idx = extract_layer_index(prefix)",) if "layer_idx" in params else ()
    )
    body = translate_init(layer, translate, prologue)

    if s.layer_spec is None:
        return _unfused_layer(plan, body)
    fwd: list[str] = []
    for i, block in enumerate(s.layer_spec.blocks):
        if i == 0:
            fwd += [
                "if residual is None:",
                "    residual = hidden_states",
                f"    hidden_states = self.{block.norm}(hidden_states)",
                "else:",
                "    # the previous layer's residual add, fused into this norm",
                f"    hidden_states, residual = self.{block.norm}(hidden_states, residual)",
            ]
        else:
            fwd.append(
                f"hidden_states, residual = self.{block.norm}(hidden_states, residual)"
            )
        if block.mixer == s.attn_attr:
            fwd.append(
                f"hidden_states = self.{block.mixer}(positions=positions, hidden_states=hidden_states)"
            )
        else:
            fwd.append(f"hidden_states = self.{block.mixer}(hidden_states)")
        fwd += [f"hidden_states = self.{p}(hidden_states)" for p in block.post_norms]
        if block.multiplier is not None:
            fwd.append(f"hidden_states = hidden_states * {block.multiplier}")
    fwd.append("return hidden_states, residual")
    return f"""
class {layer.name}(nn.Module):
    def __init__({signature(layer, LAYER_EXTRAS, drop=("layer_idx",))}) -> None:
{indent(body)}

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
{indent(fwd)}
"""


def _unfused_layer(plan: ModelPlan, init_body: list[str]) -> str:
    """The source layer's forward statement by statement, with the sublayer calls given
    vLLM's signatures: the residual adds stay where the source has them."""
    s = plan.structure
    layer = s.layer
    params = [
        p.name.value for p in layer.forward.params.params if p.name.value != "self"
    ]
    stream = params[0]
    body = cst.Module(body=list(layer.forward.body.body)).visit(
        _SublayerCalls(
            {s.attn_attr: "attention", s.mlp_attr: "mlp"},
            stream,
            set(params[1:]),
            layer.name,
        )
    )
    lines = [line for line in body.code.strip("\n").splitlines()]
    return f"""
class {layer.name}(nn.Module):
    # Residual adds not fused into the norms (see the report): the source's own layout.
    def __init__({signature(layer, LAYER_EXTRAS, drop=("layer_idx",))}) -> None:
{indent(init_body)}

    def forward(self, positions: torch.Tensor, {stream}: torch.Tensor) -> torch.Tensor:
{indent(lines)}
"""


class _SublayerCalls(cst.CSTTransformer):
    """`h, _ = self.self_attn(hidden_states=h, mask=..., ...)` -> `h = self.self_attn(positions=positions, hidden_states=h)`."""

    def __init__(
        self, kinds: dict[str, str], stream: str, other_params: set[str], owner: str
    ):
        self.kinds, self.stream, self.other_params, self.owner = (
            kinds,
            stream,
            other_params,
            owner,
        )

    def leave_Assign(self, original: cst.Assign, updated: cst.Assign) -> cst.Assign:
        value = updated.value
        if (
            m.matches(value, m.Call(func=m.Attribute(value=m.Name("self"))))
            and value.func.attr.value in self.kinds
        ):
            target = updated.targets[0].target
            if isinstance(target, cst.Tuple):
                target = target.elements[0].value
            args = [
                a
                for a in value.args
                if not a.star
                and (a.keyword is None or a.keyword.value == "hidden_states")
            ]
            if len(args) != 1:
                raise CodemodError(
                    f"cannot generate: {self.owner} calls self.{value.func.attr.value} without one hidden-states argument"
                )
            hidden = code(args[0].value)
            kind = self.kinds[value.func.attr.value]
            call = (
                f"self.{value.func.attr.value}(positions=positions, hidden_states={hidden})"
                if kind == "attention"
                else f"self.{value.func.attr.value}({hidden})"
            )
            return updated.with_changes(
                targets=[cst.AssignTarget(target)], value=cst.parse_expression(call)
            )
        return updated

    def visit_Name(self, node: cst.Name) -> None:
        if node.value in self.other_params:
            raise CodemodError(
                f"cannot generate: {self.owner}.forward uses `{node.value}` outside its sublayer calls"
            )

    def visit_Call(self, node: cst.Call) -> bool:
        # arguments of sublayer calls are rewritten, not checked
        return not (
            m.matches(node.func, m.Attribute(value=m.Name("self")))
            and node.func.attr.value in self.kinds
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


# A merge the config may not build (MLA's fused_qkv_a_proj needs a q low-rank): its
# stacked rules are dropped when this model has no such module, so the projections load
# as themselves.
BUILT_MERGES = """
    def _built_merges_mapper(self) -> WeightsMapper:
        built = {name.rsplit(".", 1)[-1] for name, _ in self.named_modules()}
        return WeightsMapper(
            orig_to_new_stacked={
                old: (new, shard)
                for old, (new, shard) in self.hf_to_vllm_mapper.orig_to_new_stacked.items()
                if new.strip(".").rsplit(".", 1)[-1] in built
            }
        )
"""


def emit_model(plan: ModelPlan) -> str:
    s = plan.structure
    base = s.base
    embed = base.attrs[s.embed_attr]
    vocab, hidden = (a.value for a in embed.args[:2])
    norm = s.norms.get(base.constructed_class(s.final_norm_attr))
    final_norm = (
        norm_construction(norm, base.attrs[s.final_norm_attr])
        if norm
        else code(base.attrs[s.final_norm_attr])
    )
    fused = s.layer_spec is not None
    keys = '["hidden_states", "residual"]' if fused else '["hidden_states"]'
    if fused:
        start = "residual = None"
        resume = 'hidden_states = intermediate_tensors["hidden_states"]\n            residual = intermediate_tensors["residual"]'
        step = "hidden_states, residual = layer(positions, hidden_states, residual)"
        send = '{"hidden_states": hidden_states, "residual": residual}'
        finish = "# the last layer's residual add, fused into the final norm\n        hidden_states, _ = self.{n}(hidden_states, residual)"
    else:
        start = "pass"
        resume = 'hidden_states = intermediate_tensors["hidden_states"]'
        step = "hidden_states = layer(positions, hidden_states)"
        send = '{"hidden_states": hidden_states}'
        finish = "hidden_states = self.{n}(hidden_states)"
    finish = finish.format(n=s.final_norm_attr)
    scale = s.embed_scale
    scale_init = "".join(
        f"\n        {line}" for line in (scale.init_lines if scale else ())
    )
    embed = f"self.{s.embed_attr}(input_ids)"
    if scale and scale.in_embedding:
        factor = (
            f"torch.tensor({scale.factor}, dtype=embeds.dtype)"
            if scale.cast
            else scale.factor
        )
        embed_body = f"embeds = {embed}\n        return embeds * {factor}"
    else:
        embed_body = f"return {embed}"
    forward_scale = (
        f"\n            hidden_states = hidden_states * {scale.factor}"
        if scale and not scale.in_embedding
        else ""
    )
    weights_arg, layout, mapper = "weights", "", "self.hf_to_vllm_mapper"
    if isinstance(s.attention, MLASpec):
        # the q/kv merge exists only with a q low-rank: without it nothing is stacked
        mapper, layout = "self._built_merges_mapper()", BUILT_MERGES
    if getattr(s.attention, "interleaved", False):
        weights_arg = "self._checkpoint_layout(weights)"
        layout = INTERLEAVED_LAYOUT.format(key=f".{s.attn_attr}.{s.attention.merged}.")
    tied = plan.tied_embeddings
    first_rank = (
        "get_pp_group().is_first_rank or (config.tie_word_embeddings and get_pp_group().is_last_rank)"
        if tied
        else "get_pp_group().is_first_rank"
    )
    stacked = ",\n".join(
        f"        {k!r}: ({v!r}, {sid!r})" for k, v, sid in plan.stacked_params()
    )
    return f"""
@support_torch_compile
class {base.name}(nn.Module):
    # checkpoint name -> (merged parameter, shard id), from the fusion records
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={{
{stacked}
        }}
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config = vllm_config.cache_config
        quant_config = vllm_config.quant_config
        self.config = config{scale_init}
        if {first_rank}:
            self.{s.embed_attr} = VocabParallelEmbedding(
                {code(vocab)}, {code(hidden)}, quant_config=quant_config, prefix=f"{{prefix}}.{s.embed_attr}"
            )
        else:
            self.{s.embed_attr} = PPMissingLayer()
        self.start_layer, self.end_layer, self.{s.layers_attr} = make_layers(
            {code(s.num_layers)},
            lambda prefix: {s.layer.name}(
                config, cache_config=cache_config, quant_config=quant_config, prefix=prefix
            ),
            prefix=f"{{prefix}}.{s.layers_attr}",
        )
        if get_pp_group().is_last_rank:
            self.{s.final_norm_attr} = {final_norm}
        else:
            self.{s.final_norm_attr} = PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            {keys}, {code(hidden)}
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        {embed_body}

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            if inputs_embeds is not None:
                hidden_states = inputs_embeds
            else:
                hidden_states = self.embed_input_ids(input_ids){forward_scale}
            {start}
        else:
            assert intermediate_tensors is not None
            {resume}
        for layer in islice(self.{s.layers_attr}, self.start_layer, self.end_layer):
            {step}
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({send})
        {finish}
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights({weights_arg}, mapper={mapper})
{layout}"""


def emit_causal_lm(plan: ModelPlan) -> str:
    s = plan.structure
    causal = s.causal
    in_size, vocab, bias = linear_args(causal.attrs[s.head_attr])
    head_bias = "" if code(bias) == "False" else f", bias={code(bias)}"
    packed = ",\n".join(
        f"        {k!r}: {v!r}" for k, v in plan.packed_modules_mapping().items()
    )
    logits = s.logits
    logits_init = "".join(f"\n        {line}" for line in logits.init_lines)
    logits_args = "".join(
        f", {k}={v}"
        for k, v in (("scale", logits.scale), ("soft_cap", logits.soft_cap))
        if v
    )
    tie = (
        f"""
            if config.tie_word_embeddings:
                self.{s.head_attr} = self.{s.head_attr}.tie_weights(self.{s.model_attr}.{s.embed_attr})"""
        if plan.tied_embeddings
        else ""
    )
    mapper, mapper_arg = "", ""
    if s.checkpoint_renames:
        fields = ", ".join(
            f"{k}={_mapping(k, v)}" for k, v in sorted(s.checkpoint_renames.items())
        )
        mapper = f"""
    # checkpoint names transformers renames at load (its conversion mapping)
    hf_to_vllm_mapper = WeightsMapper({fields})"""
        mapper_arg = ", mapper=self.hf_to_vllm_mapper"
    return f"""
class {causal.name}(nn.Module, SupportsLoRA, SupportsPP, SupportsQuant):
    # merged module -> the checkpoint modules it holds, from the fusion records
    packed_modules_mapping = {{
{packed}
    }}{mapper}
    embedding_modules = {{"{s.embed_attr}": "input_embeddings", "{s.head_attr}": "output_embeddings"}}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.config = config
        self.quant_config = quant_config{logits_init}
        self.{s.model_attr} = {s.base.name}(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "{s.model_attr}"))
        if get_pp_group().is_last_rank:
            self.{s.head_attr} = ParallelLMHead(
                {code(vocab)}, {code(in_size)}{head_bias}, quant_config=quant_config, prefix=maybe_prefix(prefix, "{s.head_attr}")
            ){tie}
        else:
            self.{s.head_attr} = PPMissingLayer()
        self.logits_processor = LogitsProcessor({code(vocab)}{logits_args})
        self.make_empty_intermediate_tensors = self.{s.model_attr}.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.{s.model_attr}.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.{s.model_attr}(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.{s.head_attr}, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights{mapper_arg})
"""


def _mapping(kind: str, renames: dict[str, str]) -> str:
    if kind != "orig_to_new_regex":
        return repr(renames)
    # raw strings: the patterns read as the regexes they are
    return (
        "{" + ", ".join(f're.compile(r"{k}"): r"{v}"' for k, v in renames.items()) + "}"
    )
