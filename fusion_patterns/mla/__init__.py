"""Multi-head latent attention -> vLLM's MLA layer (`MultiHeadLatentAttentionWrapper`,
the latent KV cache), the q and kv down-projections merged into `fused_qkv_a_proj`.

Claimed whole where the match (`match.py`) and the proof on every layer (`proof.py`)
hold and vLLM sets the model type up for latent attention (it sizes the KV cache and
picks kernels by its own list of MLA model types); its callers hand it vLLM's positions.
Elsewhere the class is copied and attends on vLLM's standard attention.
"""

from __future__ import annotations

from dataclasses import replace

from ..base import (
    CLASS,
    Claim,
    ClassInfo,
    LoaderHook,
    Pattern,
    PatternRefused,
    Refusal,
    refused_by,
)
from ..emitting import positions_call, returned_arity
from .emit import emit
from .match import MERGED, NAME, VLLM_CLASS, MLASpec, match, records
from .proof import prove, scaled_ropes

WHAT = "latent attention"

__all__ = [
    "LatentAttention",
    "MERGED",
    "MLASpec",
    "NAME",
    "VLLM_CLASS",
    "vllm_assumes_mla",
]


def vllm_assumes_mla(config) -> bool:
    """Whether vLLM's own config logic sets this model type up for MLA."""
    from vllm.transformers_utils.model_arch_config_convertor import (
        ModelArchConfigConvertorBase,
    )

    try:
        return bool(ModelArchConfigConvertorBase(config, config).is_deepseek_mla())
    except Exception:  # noqa: BLE001 - a config vLLM cannot read: not MLA to it
        return False


class LatentAttention(Pattern):
    name = NAME
    whole_on_ranks = (
        "the latent's down-projections, as vLLM's own deepseek_v2.py holds them (each "
        "rank's heads read the whole latent and its rope key)"
    )

    def claim(self, model):
        norms = model.norm_specs()
        for n in model.roles.attention:
            info = model.classes[n]
            spec = match(info, set(norms), model.source.module)
            if spec is None:
                continue
            if isinstance(spec, Refusal):
                yield spec
                continue
            try:
                if not vllm_assumes_mla(model.config):
                    raise PatternRefused(
                        f"vLLM does not set up {model.config.model_type} for latent "
                        "attention (its MLA model types)"
                    )
                ropes = unproven = None
                for path, inst in model.probe.instances.get(n, []):
                    call = model.call(inst)
                    if call is None:
                        raise PatternRefused(f"the tiny model never calls {path}")
                    args, kwargs, _ = call
                    kwargs = {**kwargs, **({"hidden_states": args[0]} if args else {})}
                    prove(
                        spec, inst, kwargs, model.config, model.config.rope_parameters
                    )
                    if ropes is None:  # the first layer: the scaled ropes proven
                        ropes, unproven = scaled_ropes(spec, model, inst, kwargs)
                spec = replace(spec, scaled_ropes=tuple(sorted((ropes or {}).items())))
                text = emit(info, spec, norms)
            except Exception as exc:  # a proof that fails or cannot run is a refusal
                yield refused_by(exc, NAME, n, WHAT)
                continue
            for rope_type, why in (unproven or {}).items():
                yield Refusal(
                    NAME,
                    n,
                    f"{rope_type} rope",
                    f"no vLLM rope computes it in latent attention ({why}); a "
                    "checkpoint with it does not load",
                )
            yield Claim(
                self,
                n,
                (spec, text, returned_arity(info)),
                CLASS,
                records=[
                    r
                    for scope in model.roles.scopes.get(n, [""])
                    for r in records(spec, scope)
                ],
                needs_positions=True,
            )

    def emit_class(self, claim: Claim, info: ClassInfo) -> str:
        return claim.spec[1]

    def call_site(self, claim: Claim, call):
        return positions_call(call, claim.spec[2])

    def loader(self, claim: Claim) -> LoaderHook:
        # the q/kv merge exists only with a q low-rank: without it nothing is stacked
        return LoaderHook(BUILT_MERGES, mapper="self._built_merges_mapper({mapper})")


# A merge the config may not build (fused_qkv_a_proj needs a q low-rank): its stacked
# rules are dropped when this model has no such module, so the projections load as
# themselves.
BUILT_MERGES = """
    def _built_merges_mapper(self, mapper: WeightsMapper) -> WeightsMapper:
        built = {name.rsplit(".", 1)[-1] for name, _ in self.named_modules()}
        stacked = {
            old: (new, shard)
            for old, (new, shard) in mapper.orig_to_new_stacked.items()
            if new.strip(".").rsplit(".", 1)[-1] in built
        }
        return WeightsMapper(**{**vars(mapper), "orig_to_new_stacked": stacked})
"""
