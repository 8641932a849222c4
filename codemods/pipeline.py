"""The pipeline, one stage per module:

    source -> probe -> roles -> claims -> copy -> assemble -> render

`generate` runs it for one modeling file: the tiny model is built once and run once,
every pattern of `fusion_patterns.registry` claims what it proves on it, every class
no pattern claimed whole is copied from its source, and the file is assembled around
them. "Native layout" is the outcome where every part is claimed.
"""

from __future__ import annotations

from . import assembly, claims, copying, layer_kinds, loading, probe, roles
from .copying import definitions
from .errors import BeyondAttention, CodemodError
from .vllm_native import unmapped
from .assembly.base_forward import mask_functions
from .plan import Plan
from .render import render
from .source import load


def generate(
    name: str, trust_remote_code: bool = False, disabled: frozenset[str] = frozenset()
) -> tuple[Plan, str]:
    """The plan and the full text of the generated file for one modeling file
    (`disabled`: names of patterns not to run, the parts they would claim copied)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    # vLLM's layers (the fused forms the proofs run) read the current config when built
    with set_current_vllm_config(VllmConfig()):
        model = claimed(name, trust_remote_code, disabled)
        plan, body = _emit(model)
    return plan, render(plan, body)


def claimed(
    name: str, trust_remote_code: bool = False, disabled: frozenset[str] = frozenset()
) -> claims.Model:
    """source -> probe -> roles -> claims: the model with every pattern's claims and
    refusals (call inside `set_current_vllm_config`)."""
    source = load(name)
    pymodule = loading.load_module(source, trust_remote_code)
    causal_cls = roles.causal_class(pymodule, source.classes, source)
    # before any tiny model is built
    probe.refuse_out_of_scope(causal_cls, source)
    # every kind of layer the source can build, in the tiny configs that build them
    kinds = layer_kinds.for_source(causal_cls, source)
    values = None
    if kinds is not None:
        layer_kinds.refuse_unservable(causal_cls, kinds, source.classes)
        values = kinds.primary
    found = probe.probe(pymodule, source.classes, causal_cls, values)
    try:
        role = roles.find(source, pymodule, causal_cls, found)
    except BeyondAttention as exc:
        raise CodemodError(unmapped(causal_cls.__name__, exc.what)) from None
    kept, branch_reads = copying.linear_reads(
        source.module, source.classes, role.wanted
    )
    model = claims.run(
        claims.Model(
            source=source,
            pymodule=pymodule,
            config=found.config,
            probe=found,
            roles=role,
            tp_plan=claims.tp_plan(
                found.config, found.model, role.base_attr, source.classes
            ),
            kept_linears=kept,
            branch_reads=branch_reads,
        ),
        disabled,
    )
    layer_kinds.refuse_unclaimed_state(kinds, model)
    return model


def _emit(model: claims.Model) -> tuple[Plan, str]:
    """copy -> assemble: the plan and the file's body (imports and classes)."""
    defs = definitions.collect(model.source)
    copied = copying.copy_classes(model, defs, mask_functions(defs.imports))
    plan = Plan(
        source=model.source,
        causal_name=model.roles.causal.name,
        records=[r for c in model.claims for r in c.records] + copied.records,
        refusals=model.refusals,
        unfused=copied.unfused,
    )
    built = assembly.assemble(model, copied, defs, plan)
    plan.unfused += built.unfused
    plan.environment.update(built.environment)
    plan.cpu_dtype = next(
        (c.pattern.cpu_dtype for c in model.claims if c.pattern.cpu_dtype), None
    )
    return plan, built.text
