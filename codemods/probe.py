"""Stage 2: build the source's own tiny model once and run it once, recording what the
later stages need to know about it: the modules each class is instantiated as, what
every module is called with and returns (its first call), and, for every attention
layer, what it hands its attention interface (query/key/value, the mask, the keyword
arguments) or its own attention core, and what that returns.

The probe runs the copy's own branches: the model runs under an attention
implementation that is none of transformers' (as under vLLM, where the copy reads
`"vllm"`), registered to call each class's own eager function and record what it is
handed, with eager masks so each layer's window shows. Every layer is seen in one pass.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, code

from .attention_calls import (
    AttentionCall,
    eager_functions,
    interface_call,
    interface_name,
)
from .errors import CodemodError

PROBE_TOKENS = 40  # past the tiny windows (8) and the shrunk lengths (32), so both show in the masks
PROBE_IMPL = "codemods_probe"


@dataclass
class Probe:
    model: object
    config: object
    # class name -> [(module path in the causal LM, instance)]
    instances: dict[str, list[tuple[str, object]]] = field(default_factory=dict)
    calls: list[AttentionCall] = field(default_factory=list)
    # id(module) -> (args, kwargs, output) of its first call, for the classes asked for
    module_calls: dict[int, tuple] = field(default_factory=dict)
    # classes that compute attention themselves -> (their core, what each layer's
    # core was handed and returned)
    eager: dict[str, tuple] = field(default_factory=dict)

    def first(self, cls: str):
        found = self.instances.get(cls)
        return found[0][1] if found else None

    def calls_of(self, cls: str) -> list[AttentionCall]:
        return [c for c in self.calls if type(c.module).__name__ == cls]


def run(
    pymodule: types.ModuleType,
    model,
    config,
    attention_classes: dict[str, ClassInfo],
    vocab: int,
    patches=(),
    recorded: set[str] = frozenset(),
) -> Probe:
    """One forward of `model` with every attention class's eager function wrapped."""
    import torch

    probe = Probe(model=model, config=config)
    for path, module in model.named_modules():
        probe.instances.setdefault(type(module).__name__, []).append((path, module))
    paths = {id(mod): path for path, mod in model.named_modules()}

    functions = {
        name
        for name, value in vars(pymodule).items()
        if isinstance(value, types.FunctionType)
    }
    eager: dict[str, object] = {}
    for name, info in attention_classes.items():
        if info.forward is None:
            continue
        found = sorted(eager_functions(info.forward, functions))
        if found:
            eager[name] = getattr(pymodule, found[0])
    if not eager:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        default = sdpa_attention_forward
    else:
        default = next(iter(eager.values()))

    seen: set[int] = set()

    def recording(module, query, key, value, attention_mask, *args, **kwargs):
        original = eager.get(type(module).__name__, default)
        out = original(module, query, key, value, attention_mask, *args, **kwargs)
        if id(module) not in seen:
            seen.add(id(module))
            # positional extras (a scaling passed by position) by their names
            bound = (
                inspect.signature(original)
                .bind_partial(
                    module, query, key, value, attention_mask, *args, **kwargs
                )
                .arguments
            )
            named = dict(list(bound.items())[5:])
            for extra in [k for k, v in named.items() if isinstance(v, dict)]:
                named.update(named.pop(extra))
            probe.calls.append(
                AttentionCall(
                    module=module,
                    path=paths.get(id(module), ""),
                    query=query.detach().clone(),
                    key=key.detach().clone(),
                    value=value.detach().clone(),
                    mask=(
                        None
                        if attention_mask is None
                        else attention_mask.detach().clone()
                    ),
                    kwargs={k: _detach(v) for k, v in named.items()},
                    output=(out[0] if isinstance(out, tuple) else out).detach().clone(),
                )
            )
        return out

    # the probe runs the copy's own branches: an attention implementation that is none
    # of transformers' (as under vLLM), with eager masks so every layer's window shows
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def hook(module, args, kwargs, output):
        if id(module) not in probe.module_calls:
            import copy

            probe.module_calls[id(module)] = (
                copy.deepcopy(args),
                copy.deepcopy(
                    {k: v for k, v in kwargs.items() if k != "past_key_values"}
                ),
                _detach(output[0] if isinstance(output, (tuple, list)) else output),
            )

    handles = [
        mod.register_forward_hook(hook, with_kwargs=True)
        for mod in model.modules()
        if type(mod).__name__ in recorded
    ]
    ALL_ATTENTION_FUNCTIONS.register(PROBE_IMPL, recording)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PROBE_IMPL, eager_mask)
    configs = {
        id(mod.config): mod.config
        for mod in model.modules()
        if hasattr(mod, "config") and hasattr(mod.config, "_attn_implementation")
    }
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = PROBE_IMPL
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            ids = torch.randint(
                0, vocab, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(3)
            )
            model(input_ids=ids, use_cache=False)
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]
        for handle in handles:
            handle.remove()
    return probe


LOCALS_ATTR = "_codemods_init_locals"


@contextlib.contextmanager
def init_locals(pymodule, infos: list[ClassInfo]):
    """While the tiny model is built, each of these classes' `__init__` keeps its final
    local variables (the numbers it computed but did not store, like a per-layer kv head
    count): the faithful attention is built at the end of that same `__init__`, so they
    are valid expressions there."""
    import textwrap

    originals = {}
    for info in infos:
        cls = getattr(pymodule, info.name, None)
        if info.init is None or cls is None:
            continue

        class _Super(cst.CSTTransformer):
            def leave_Call(self, original, updated):
                if m.matches(updated, m.Call(func=m.Name("super"), args=[])):
                    return cst.parse_expression(f"super({info.name}, self)")
                return updated

        func = info.init.with_changes(decorators=[]).visit(_Super())
        keep = cst.parse_statement(
            f"self.__dict__['{LOCALS_ATTR}'] = {{k: v for k, v in locals().items() "
            "if isinstance(v, (int, float, bool, str)) or v is None}\n"
        )
        body = func.body.with_changes(body=[*func.body.body, keep])
        func = func.with_changes(body=body)
        namespace = dict(vars(pymodule))
        try:
            exec(
                textwrap.dedent(code(func)), namespace
            )  # noqa: S102 - the source's code
        except SyntaxError:
            continue
        originals[cls] = cls.__init__
        cls.__init__ = namespace["__init__"]
    try:
        yield
    finally:
        for cls, init in originals.items():
            cls.__init__ = init


def _detach(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def probe(pymodule, classes: dict[str, ClassInfo], causal_cls, values) -> Probe:
    """The tiny model `values` build (one build per `apply`), run once."""
    from .copying import eager_attention

    # attention classes keep their __init__ locals while the tiny model is built
    candidates = [
        info
        for info in classes.values()
        if info.forward is not None
        and (interface_call(info.forward) or eager_attention.find(info))
    ]
    with init_locals(pymodule, candidates):
        config, model = build(causal_cls, values)
    refuse_encoder_decoder(causal_cls, config)
    built = [
        n
        for n in dict.fromkeys(type(x).__name__ for x in model.modules())
        if n in classes
    ]
    attention = {
        n: classes[n]
        for n in built
        if classes[n].forward is not None and interface_call(classes[n].forward)
    }
    eager = {
        n: (core, [])
        for n in built
        if n not in attention and (core := eager_attention.find(classes[n])) is not None
    }
    patches = [
        eager_attention.instrumented(
            pymodule, getattr(pymodule, n), core, classes[n], sink
        )
        for n, (core, sink) in eager.items()
    ]
    try:
        found = run(
            pymodule, model, config, attention, config.vocab_size, patches, set(built)
        )
    except CodemodError:
        raise
    except Exception as exc:
        raise CodemodError(
            f"cannot run a tiny {causal_cls.__name__} from the source: "
            f"{type(exc).__name__}: {one_line(exc)}"
        ) from None
    found.eager = eager
    return found


def refuse_encoder_decoder(causal_cls, config=None) -> None:
    """Out of scope: an encoder-decoder model or its decoder. BART-style ...ForCausalLM
    classes switch the flag off on the config they are given: the config class's own
    default says the decoder's layers hold cross attention."""
    from .errors import CodemodError

    if getattr(config, "is_encoder_decoder", False) or (
        getattr(causal_cls.config_class, "is_encoder_decoder", False) is True
    ):
        raise CodemodError(
            f"out of scope: {causal_cls.__name__} is an encoder-decoder model or its "
            "decoder (cross attention; vLLM's Transformers backend serves decoders only)"
        )


def refuse_other_outputs(causal_cls) -> None:
    """Out of scope: not a text LM: a causal LM transformers says generates something
    else (`output_modalities`: MusicGen's audio codebooks, one token per codebook at
    each step), where vLLM's text generation samples one text token per step."""
    from .errors import CodemodError

    outputs = getattr(causal_cls, "output_modalities", None) or ("text",)
    outputs = (outputs,) if isinstance(outputs, str) else tuple(outputs)
    if "text" not in outputs:
        raise CodemodError(
            f"out of scope: not a text LM: {causal_cls.__name__} generates "
            f"{' and '.join(outputs)} (transformers' output_modalities), not text"
        )


def refuse_out_of_scope(causal_cls, source) -> None:
    """Out of scope before anything is built: an encoder-decoder model or its decoder,
    a causal LM generating audio, a bidirectional encoder whose causal-LM head is the same stack run with a causal
    mask (transformers maps its model type to a masked-LM head too: the BERT family),
    a causal LM that cannot run from token ids alone, or a file in which nothing
    attends (Mamba 2: its tiny config need not even validate to say so)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    info = source.classes.get(causal_cls.__name__)
    refuse_encoder_decoder(causal_cls)
    refuse_other_outputs(causal_cls)
    if info is not None and (needed := _required_inputs(info)):
        raise CodemodError(
            f"out of scope: not a standalone LM: {info.name}.forward raises without "
            f"{' and '.join(f'`{n}`' for n in needed)}, which token ids alone do not "
            "give (a draft model that reads another model's states: vLLM runs such "
            "a model only inside its speculative decoding)"
        )
    model_type = getattr(causal_cls.config_class, "model_type", None)
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        raise CodemodError(
            f"out of scope: encoder (bidirectional: transformers maps {model_type} to "
            f"a masked-LM head, and {causal_cls.__name__} runs that encoder causally; "
            "the BERT family): vLLM serves such models as pooling models"
        )
    if info is not None and _decoder_only_by_flag(info):
        raise CodemodError(
            f"out of scope: encoder (bidirectional unless its config says "
            f"`is_decoder`: {causal_cls.__name__}.__init__ checks the flag, and its "
            "stack runs causally only with it; the BERT family): vLLM serves such "
            "models as pooling models"
        )
    if not _attends(source):
        from .vllm_native import unmapped

        raise CodemodError(
            unmapped(
                causal_cls.__name__,
                f"no class of {source.path.name} calls transformers' attention "
                "interface or computes attention itself: a mixer that is not attention "
                "(vLLM's Transformers backend cannot serve it either)",
            )
        )


def _decoder_only_by_flag(info: ClassInfo) -> bool:
    """The causal LM's `__init__` tests `not config.is_decoder` (BERT-Generation's
    "add `is_decoder=True`" warning): its layers are an encoder's, causal only when
    a config flag says so, not a decoder's."""
    if info.init is None:
        return False
    flag = m.Attribute(value=m.Name("config"), attr=m.Name("is_decoder"))
    return bool(
        m.findall(
            info.init,
            m.If(test=m.UnaryOperation(operator=m.Not(), expression=flag)),
        )
    )


def _attends(source) -> bool:
    """Some class of the file attends, or the file builds on another model's modules
    (`from ..llama.modeling_llama import ...`, `AutoModel`), which may."""
    from .copying import eager_attention

    for imp in m.findall(source.module, m.ImportFrom()):
        names = [] if isinstance(imp.names, cst.ImportStar) else imp.names
        parts = (code(imp.module) if imp.module is not None else "").split(".")
        # a model package's modules, not transformers' own `modeling_utils`
        sibling = len(parts) > 1 and parts[-2] != "transformers"
        if (sibling and parts[-1].startswith("modeling_")) or any(
            code(a.name).startswith("AutoModel") for a in names
        ):
            return True
    from fusion_patterns.registry import state_patterns

    return any(
        info.forward is not None
        # any interface lookup counts: DiffLlama calls it twice (a refusal by roles,
        # not a mixer out of scope)
        and (interface_name(info.forward) or eager_attention.find(info))
        for info in source.classes.values()
    ) or any(  # a mixer a pattern maps onto vLLM's state cache (Mamba 2)
        state_patterns(info) for info in source.classes.values()
    )


def _required_inputs(info: ClassInfo) -> list[str]:
    """The forward parameters besides `input_ids` whose absence alone makes the forward
    raise (`if inputs_embeds is None or shared_kv_states is None: raise ...`, at the
    top of the forward). "Either ids or embeddings" checks raise only when both are
    missing, and are not this."""
    if info.forward is None:
        return []
    params = {p.name.value for p in info.forward.params.params} - {"self", "input_ids"}
    needed: list[str] = []
    for stmt in info.forward.body.body:
        if not m.matches(
            stmt, m.If(body=m.IndentedBlock([m.SimpleStatementLine([m.Raise()])]))
        ):
            continue
        tests = [stmt.test]
        while tests and isinstance(tests[-1], cst.BooleanOperation):
            op = tests.pop()
            if not isinstance(op.operator, cst.Or):
                break
            tests += [op.left, op.right]
        for test in tests:
            if (
                m.matches(
                    test,
                    m.Comparison(
                        left=m.Name(),
                        comparisons=[m.ComparisonTarget(m.Is(), m.Name("None"))],
                    ),
                )
                and test.left.value in params
            ):
                needed.append(test.left.value)
    return needed


def build(causal_cls, values: dict | None = None):
    """(config, model) of the tiny model, its weights random (norms too)."""
    import torch

    from . import tiny

    try:
        if values is None:
            values = tiny.working_values(causal_cls)
        config = causal_cls.config_class(**values)
        config._attn_implementation = "eager"
        # the experts' own forward, as the source writes it: transformers would otherwise
        # dispatch `@use_experts_implementation` classes to its library kernels
        # (grouped_mm), and the proofs would prove those instead of the source
        config._experts_implementation = "eager"
        torch.manual_seed(0)
        model = causal_cls(config).float().eval()
    except Exception as exc:
        raise CodemodError(
            f"cannot build a tiny {causal_cls.__name__} from the source: "
            f"{type(exc).__name__}: {one_line(exc)}"
        ) from None
    tiny.randomize(model)
    return config, model


def one_line(exc) -> str:
    """An exception's message on one line (a validator's error says its reason on the
    second)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
