"""Stage 3: prove each matched fusion on the real transformers module.

A libcst match only shows that source text looks like a pattern. Here each pattern's
proof runs on instances from a tiny random model built from the source's own classes:
the torch.fx dataflow the pattern assumes, then the fused form against the module on
random inputs (fp32, max relative error 1e-5). A failed proof is a refusal: that part
is emitted unfused (still correct), or, for the attention, nothing is written.
"""

from __future__ import annotations


from fusion_patterns import glu, mla, moe, qkv, residual_norm, rms_norm
from fusion_patterns.base import PatternRefused, Refusal

from . import checkpoint_names, loading, tiny
from .errors import CodemodError
from .structure import ModelStructure, cannot_generate


def _first_instances(model) -> dict[str, object]:
    out: dict[str, object] = {}
    for module in model.modules():
        out.setdefault(type(module).__name__, module)
    return out


def _capture_calls(model, modules: list, vocab: int) -> list[dict]:
    """The keyword arguments each of `modules` is called with, from one forward of the
    model (one hook per module, so every layer is captured in the same pass)."""
    import torch

    seen: list[dict] = [{} for _ in modules]

    def hook_for(i):
        def hook(mod, args, kwargs):
            if not seen[i]:
                seen[i].update(kwargs)
                if args:
                    seen[i]["hidden_states"] = args[0]

        return hook

    handles = [
        module.register_forward_pre_hook(hook_for(i), with_kwargs=True)
        for i, module in enumerate(modules)
    ]
    try:
        with torch.no_grad():
            ids = torch.randint(
                0, vocab, (1, 7), generator=torch.Generator().manual_seed(3)
            )
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    for call in seen:
        call.pop("past_key_values", None)  # the proofs call the module again: no cache
    return seen


def validate(
    structure: ModelStructure,
    trust_remote_code: bool = False,
    values: dict | None = None,
) -> None:
    """Prove every fusion in `structure` on the tiny model of `values` (default: the
    tiny config); drop (and record) the ones that fail."""
    from vllm.config import VllmConfig, set_current_vllm_config

    # vLLM's layers (the fused forms the proofs run) read the current config when built
    with set_current_vllm_config(VllmConfig()):
        _validate(structure, trust_remote_code, values)


def _validate(structure: ModelStructure, trust_remote_code: bool, values) -> None:
    import torch

    s = structure
    module = loading.load_module(s.source, trust_remote_code)
    causal_cls = getattr(module, s.causal.name)
    moes = [spec for spec in s.mlps.values() if isinstance(spec, moe.MoESpec)]
    s.checkpoint_renames = checkpoint_names.renames(
        causal_cls,
        causal_cls.config_class.model_type,
        (moes[0].experts.gate_up, moes[0].experts.down) if moes else None,
    )
    try:
        config = (
            causal_cls.config_class(**values)
            if values is not None
            else tiny.tiny_config(causal_cls.config_class)
        )
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = causal_cls(config).float().eval()
    except Exception as exc:  # the source's own code failed: say so in one line
        raise CodemodError(
            f"cannot build a tiny {s.causal.name} from the source to prove the fusions: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    tiny.randomize(model)
    instances = _first_instances(model)
    if isinstance(s.attention, mla.MLASpec):
        from .faithful.generate import _vllm_assumes_mla

        if not _vllm_assumes_mla(config):
            # vLLM sizes the KV cache and picks kernels by its own list of MLA model
            # types; a latent cache for another type would not be set up
            raise CodemodError(
                f"cannot generate: vLLM does not set up {config.model_type} for latent "
                "attention (its MLA model types), so its attention cannot be vLLM's MLA layer"
            )

    for name, spec in list(s.norms.items()):
        try:
            if name not in instances:
                raise PatternRefused("no instance of the class in the model")
            rms_norm.prove(spec, instances[name])
        except PatternRefused as why:
            del s.norms[name]
            s.refuse(Refusal(rms_norm.NAME, name, name, str(why)))

    # every layer: layers may differ in rope, window or norms by their layer type
    attentions = [
        mod for mod in model.modules() if type(mod).__name__ == s.attention.class_name
    ]
    try:
        calls = _capture_calls(model, attentions, config.vocab_size)
    except Exception as exc:  # the source's own forward failed: say so in one line
        raise CodemodError(
            f"cannot run a tiny {s.causal.name} from the source to prove the fusions: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        ) from None
    try:
        for layer_idx, (attention, call) in enumerate(zip(attentions, calls)):
            if isinstance(s.attention, mla.MLASpec):
                mla.prove(
                    s.attention,
                    attention,
                    call,
                    config,
                    s.rope_parameters(config, layer_idx),
                )
                continue
            qkv.prove(
                s.attention,
                attention,
                call,
                config,
                s.rope_parameters(config, layer_idx),
                s.neox_rotary,
                set(s.norms),
            )
    except PatternRefused as why:
        s.refuse(
            Refusal(
                mla.NAME if isinstance(s.attention, mla.MLASpec) else qkv.NAME,
                s.attention.class_name,
                "attention projections",
                str(why),
            )
        )
        raise cannot_generate(
            s.refusals, "no unfused attention form is emitted yet"
        ) from None

    for cls, spec in list(s.mlps.items()):
        if cls not in instances:
            # a class the tiny config never builds cannot be proven, nor sharded unfused
            raise CodemodError(
                f"cannot generate: the tiny {s.causal.name} builds no {cls} to prove it on"
            )
        if isinstance(spec, moe.MoESpec):
            try:
                moe.prove(spec, instances[cls], config)
            except PatternRefused as why:
                s.refuse(Refusal(moe.NAME, cls, "router + experts", str(why)))
                raise cannot_generate(
                    s.refusals, "no unfused MoE form is emitted yet"
                ) from None
            continue
        if spec is not None:
            try:
                glu.prove(spec, instances[cls], config)
            except PatternRefused as why:
                s.refuse(Refusal(glu.NAME, cls, "gate/up projections", str(why)))
                s.mlps[cls] = spec = None
        if spec is None:
            s.mlp_sharding[cls] = unfused_mlp_sharding(instances[cls])

    if s.layer_spec is not None:
        layer = instances[s.layer.name]
        try:
            unproven = [
                b.norm
                for b in s.layer_spec.blocks
                if b.norm not in s.norm_attrs(s.layer)
            ]
            if unproven:
                raise PatternRefused(f"self.{unproven[0]} is not a proven RMSNorm")
            residual_norm.prove(s.layer_spec, layer)
        except PatternRefused as why:
            s.refuse(
                Refusal(
                    residual_norm.NAME, s.layer.name, "residual add + norm", str(why)
                )
            )
            s.layer_spec = None
    if s.final_norm_attr not in s.norm_attrs(s.base) and s.layer_spec is not None:
        raise CodemodError(
            f"cannot generate: the final norm {s.base.name}.{s.final_norm_attr} is not a proven RMSNorm"
        )


# Ops that act element by element, so they commute with a column split of the features.
ELEMENTWISE = {
    "mul",
    "add",
    "sub",
    "truediv",
    "neg",
    "pow",
    "tanh",
    "sigmoid",
    "relu",
    "gelu",
    "silu",
    "exp",
    "clamp",
}
ACTIVATION_MODULES = ("transformers.activations", "torch.nn.modules.activation")


def unfused_mlp_sharding(module) -> tuple[list[str], list[str]]:
    """(column-parallel, row-parallel) projections of an MLP kept unfused, proven safe to
    shard: the columns read the input, one row projection produces the output, and only
    elementwise ops run between them."""
    from torch import nn

    from fusion_patterns.dataflow import trace

    name = type(module).__name__
    try:
        graph = trace(module)
    except PatternRefused as why:
        raise CodemodError(f"cannot generate: unfused {name}: {why}") from None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    columns, rows = [], []
    for node in graph.nodes:
        if node.op == "call_module" and isinstance(
            module.get_submodule(str(node.target)), nn.Linear
        ):
            if node.args[0] in placeholders[:1]:
                columns.append(str(node.target))
            elif node in output.all_input_nodes:
                rows.append(str(node.target))
            else:
                raise CodemodError(
                    f"cannot generate: unfused {name}: self.{node.target} neither reads the input nor makes the output"
                )
        elif node.op == "call_module":
            if not type(module.get_submodule(str(node.target))).__module__.startswith(
                ACTIVATION_MODULES
            ):
                raise CodemodError(
                    f"cannot generate: unfused {name}: self.{node.target} is not an elementwise activation"
                )
        elif node.op in ("call_function", "call_method"):
            op = getattr(node.target, "__name__", str(node.target))
            if op not in ELEMENTWISE:
                raise CodemodError(
                    f"cannot generate: unfused {name}: `{op}` between its projections is not elementwise"
                )
    if not columns or len(rows) != 1:
        raise CodemodError(
            f"cannot generate: unfused {name}: expected projections in, one projection out"
        )
    return columns, rows
