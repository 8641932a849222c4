"""The decoder layer (fused residual + norm), the base model (pipeline parallel) and the
causal LM (head, logits, weight loading), laid out as vLLM's native files are."""

from __future__ import annotations

import libcst as cst

from fusion_patterns.base import code, linear_args

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
        raise CodemodError(f"cannot generate: {layer.name}.__init__ takes {sorted(unknown)}, not emitted yet")

    def translate(attr: str, value: cst.BaseExpression) -> list[str] | None:
        if attr in extras:
            return [f"self.{attr} = {with_extras(value, extras[attr], attr)}"]
        if norm := s.norms.get(layer.constructed_class(attr) or ""):
            return [f"self.{attr} = {norm_construction(norm, value)}"]
        return None

    prologue = ("layer_idx = extract_layer_index(prefix)",) if "layer_idx" in params else ()
    body = translate_init(layer, translate, prologue)

    fwd: list[str] = []
    for i, block in enumerate(s.layer_spec.blocks):
        if i == 0:
            fwd += [
                "if residual is None:",
                "    residual = hidden_states",
                f"    hidden_states = self.{block.norm}(hidden_states)",
                "else:",
                f"    # the previous layer's residual add, fused into this norm",
                f"    hidden_states, residual = self.{block.norm}(hidden_states, residual)",
            ]
        else:
            fwd.append(f"hidden_states, residual = self.{block.norm}(hidden_states, residual)")
        if block.mixer == s.attn_attr:
            fwd.append(f"hidden_states = self.{block.mixer}(positions=positions, hidden_states=hidden_states)")
        else:
            fwd.append(f"hidden_states = self.{block.mixer}(hidden_states)")
    fwd.append("return hidden_states, residual")
    return f'''
class {layer.name}(nn.Module):
    def __init__({signature(layer, LAYER_EXTRAS, drop=("layer_idx",))}) -> None:
{indent(body)}

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
{indent(fwd)}
'''


def emit_model(plan: ModelPlan) -> str:
    s = plan.structure
    base = s.base
    embed = base.attrs[s.embed_attr]
    vocab, hidden = (a.value for a in embed.args[:2])
    norm = s.norms[base.constructed_class(s.final_norm_attr)]
    tied = plan.tied_embeddings
    first_rank = (
        "get_pp_group().is_first_rank or (config.tie_word_embeddings and get_pp_group().is_last_rank)"
        if tied
        else "get_pp_group().is_first_rank"
    )
    stacked = ",\n".join(f"        {k!r}: ({v!r}, {sid!r})" for k, v, sid in plan.stacked_params())
    return f'''
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
        self.config = config
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
            self.{s.final_norm_attr} = {norm_construction(norm, base.attrs[s.final_norm_attr])}
        else:
            self.{s.final_norm_attr} = PPMissingLayer()
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], {code(hidden)}
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.{s.embed_attr}(input_ids)

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
                hidden_states = self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in islice(self.{s.layers_attr}, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({{"hidden_states": hidden_states, "residual": residual}})
        # the last layer's residual add, fused into the final norm
        hidden_states, _ = self.{s.final_norm_attr}(hidden_states, residual)
        return hidden_states

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
'''


def emit_causal_lm(plan: ModelPlan) -> str:
    s = plan.structure
    causal = s.causal
    in_size, vocab, bias = linear_args(causal.attrs[s.head_attr])
    head_bias = "" if code(bias) == "False" else f", bias={code(bias)}"
    packed = ",\n".join(f"        {k!r}: {v!r}" for k, v in plan.packed_modules_mapping().items())
    tie = (
        f"""
            if config.tie_word_embeddings:
                self.{s.head_attr} = self.{s.head_attr}.tie_weights(self.{s.model_attr}.{s.embed_attr})"""
        if plan.tied_embeddings
        else ""
    )
    return f'''
class {causal.name}(nn.Module, SupportsLoRA, SupportsPP, SupportsQuant):
    # merged module -> the checkpoint modules it holds, from the fusion records
    packed_modules_mapping = {{
{packed}
    }}
    embedding_modules = {{"{s.embed_attr}": "input_embeddings", "{s.head_attr}": "output_embeddings"}}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        self.config = config
        self.quant_config = quant_config
        self.{s.model_attr} = {s.base.name}(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "{s.model_attr}"))
        if get_pp_group().is_last_rank:
            self.{s.head_attr} = ParallelLMHead(
                {code(vocab)}, {code(in_size)}{head_bias}, quant_config=quant_config, prefix=maybe_prefix(prefix, "{s.head_attr}")
            ){tie}
        else:
            self.{s.head_attr} = PPMissingLayer()
        self.logits_processor = LogitsProcessor({code(vocab)})
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
        return loader.load_weights(weights)
'''
