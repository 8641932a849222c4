"""Experts stacked [experts, hidden, 2 * intermediate] and applied as `x @ W` (Aria,
GPT-OSS), with `down` [experts, intermediate, hidden]. Two layouts of the 2I, decided by
the proof, not by the spelling:
- halves, `act(gate) * up` with the class's `ACT2FN` activation (Aria): vLLM's fused MoE
  with that activation, its loader reading the stacked tensors transposed
  (`is_fused_checkpoint_transposed`);
- gate and up interleaved, a bias on each projection, the clamped gate
  `(clamp(up) + 1) * g * sigmoid(alpha * g)`, g = clamp(gate) (GPT-OSS): vLLM's fused
  `swigluoai` (alpha 1.702, limit 7.0, interleaved w13), loaded per expert through
  vLLM's own loader for this layout (gpt-oss's `GptOssRoutedExperts`: this rank's
  contiguous share of the interleaved 2I, transposed; the down bias on one rank).

Matched on the parameters `__init__` builds (two 3-D ones, one `2 * <size>` wide in its
last dim, and 2-D biases beside them); proven on random weights, inputs that reach past
a clamp, and random routings, against vLLM's fused form written out. Config fields the
module reads as numbers that move its output (alpha, the limit) are proven at the tiny
model's values only, which must be vLLM's: the generated factory refuses a config with
others at build time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import libcst as cst
import libcst.matchers as m

from ..base import LoaderHook, PatternRefused, code
from ..moe.match import ACT2FN_LOOKUP, resolve
from ..moe.proof import evaluate, experts_reference

HALVES, INTERLEAVED = "halves", "interleaved"
# vLLM's fused activation for the interleaved layout, and its fixed constants
SWIGLUOAI = "swigluoai"
VLLM_ALPHA, VLLM_LIMIT = 1.702, 7.0
# vLLM's loader of interleaved [H, 2I] experts (its shard ids), by parameter
W13, W2 = "gpt_oss_w13", "gpt_oss_w2"

_EMPTY = m.Call(
    func=m.Attribute(
        value=m.Name("torch"), attr=m.Name("empty") | m.Name("zeros") | m.Name("randn")
    )
)
_PARAMETER = m.Call(
    func=m.Attribute(value=m.Name("nn"), attr=m.Name("Parameter"))
    | m.Name("Parameter"),
    args=[m.Arg(_EMPTY), m.ZeroOrMore()],
)
_DOUBLE = m.BinaryOperation(left=m.Integer("2"), operator=m.Multiply())


@dataclass(frozen=True)
class TransposedExperts:
    class_name: str
    gate_up: str
    down: str
    gate_up_bias: str | None
    down_bias: str | None
    num_experts: cst.BaseExpression
    hidden: cst.BaseExpression
    intermediate: cst.BaseExpression
    # the class's `ACT2FN[...]` key, if it holds one (the halves layout's activation)
    act_name: cst.BaseExpression | None
    # the proof's findings: the layout, and (config field, its tiny value) the
    # interleaved form was proven at, which vLLM's kernel fixes
    layout: str = ""
    fixed: tuple[tuple[str, float], ...] = ()

    @property
    def sources(self) -> tuple[str, str]:
        return (self.gate_up, self.down)

    @property
    def stacked(self) -> tuple[str, str] | None:
        """The stacked names vLLM's own loader reads (the halves layout); the
        interleaved one is loaded by the hook below."""
        return self.sources if self.layout == HALVES else None

    def factory_args(self, info) -> dict[str, object]:
        sizes = {
            "num_experts": resolve(self.num_experts, info, {}),
            "hidden_size": resolve(self.hidden, info, {}),
            "intermediate_size": resolve(self.intermediate, info, {}),
        }
        if self.layout == HALVES:
            return {
                **sizes,
                "activation": resolve(self.act_name, info, {}),
                "is_fused_checkpoint_transposed": cst.Name("True"),
            }
        return {
            **sizes,
            "activation": cst.SimpleString(f'"{SWIGLUOAI}"'),
            "has_bias": cst.Name(
                "True" if self.gate_up_bias or self.down_bias else "False"
            ),
            "routed_experts_cls": cst.Name("GptOssRoutedExperts"),
        }

    def guards(self) -> list[str]:
        if not self.fixed:
            return []
        fields = [f"config.{f}" for f, _ in self.fixed]
        values = [repr(v) for _, v in self.fixed]
        if len(self.fixed) > 1:
            fields, values = [f"({', '.join(fields)})"], [f"({', '.join(values)})"]
        return [
            f"# vLLM's fused {SWIGLUOAI} computes these values only (proven at them)",
            f"if {fields[0]} != {values[0]}:",
            "    raise ValueError(",
            f'        "{self.class_name}: vLLM\'s fused {SWIGLUOAI} computes "',
            f'        "{", ".join(f"{f}={v!r}" for f, v in self.fixed)} only"',
            "    )",
        ]

    def loader(self) -> LoaderHook | None:
        if self.layout != INTERLEAVED:
            return None
        table = {
            self.gate_up: ("w13_weight", W13),
            self.down: ("w2_weight", W2),
            **({self.gate_up_bias: ("w13_bias", W13)} if self.gate_up_bias else {}),
            **({self.down_bias: ("w2_bias", W2)} if self.down_bias else {}),
        }
        return LoaderHook(
            LOADER.format(table=repr(table)),
            "self._interleaved_experts({weights}, loaded)",
            reports_loaded=True,
        )

    def prove(self, config, info, module, check) -> "TransposedExperts":
        """`check(reference, hidden, experts, scale)`: the module (its weights randomised here)
        against `reference` on random inputs of that scale and random routings. The
        form with the layout that computes it."""
        import torch

        gate_up, down = getattr(module, self.gate_up), getattr(module, self.down)
        biases = [
            getattr(module, b) if b else None
            for b in (self.gate_up_bias, self.down_bias)
        ]
        known = {self.gate_up, self.down, self.gate_up_bias, self.down_bias}
        extra = [n for n, _ in module.named_parameters() if n not in known]
        if extra:
            raise PatternRefused(f"they also hold {', '.join(extra)}")
        experts, hidden, two_i = gate_up.shape
        built = tuple(
            evaluate(resolve(e, info, {}), config, "an experts size")
            for e in (self.num_experts, self.hidden, self.intermediate)
        )
        if built != (experts, hidden, two_i // 2) or tuple(down.shape) != (
            experts,
            two_i // 2,
            hidden,
        ):
            raise PatternRefused(
                f"their sizes read from the config {built} are not the ones built "
                f"{(experts, hidden, two_i // 2)} (down {tuple(down.shape)})"
            )
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            gate_up.copy_(torch.randn(gate_up.shape, generator=gen) / hidden**0.5)
            down.copy_(torch.randn(down.shape, generator=gen) / (two_i // 2) ** 0.5)
            for b in biases:
                if b is not None:
                    b.copy_(0.5 * torch.randn(b.shape, generator=gen))
        w13 = gate_up.transpose(1, 2)  # [E, 2I, H], as vLLM's w13
        w2 = down.transpose(1, 2)
        why = []
        for layout, act in self._activations(config, info, biases):
            if isinstance(act, str):  # the layout cannot be this one: why
                why.append(f"{layout}: {act}")
                continue

            def reference(x, chosen, w, act=act):
                return experts_reference(x, chosen, w, w13, w2, act, *biases)

            try:
                # inputs well inside a clamp, and far past it (|gate|, |up| > 7)
                for scale in (1.0, 12.0):
                    check(reference, hidden, experts, scale)
            except PatternRefused as exc:
                why.append(f"{layout}: {exc}")
                continue
            fixed = ()
            if layout == INTERLEAVED:
                fixed = _fixed_fields(
                    info, module, lambda: check(None, hidden, experts, 12.0)
                )
            return replace(self, layout=layout, fixed=fixed)
        raise PatternRefused("neither layout computes them (" + "; ".join(why) + ")")

    def _activations(self, config, info, biases):
        """(layout, vLLM's activation for it, or why there is none), in order."""
        from vllm.model_executor.layers.activation import (
            SwigluOAIAndMul,
            get_act_and_mul_fn,
        )
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        if self.act_name is None:
            yield HALVES, "no ACT2FN activation"
        elif any(b is not None for b in biases):
            yield HALVES, "biases on a halves layout are not loaded yet"
        else:
            key = str(
                evaluate(resolve(self.act_name, info, {}), config, "the activation")
            )
            try:
                MoEActivation.from_str(key)
                yield HALVES, get_act_and_mul_fn(key).forward_native
            except ValueError:
                yield HALVES, f"vLLM's fused MoE has no activation {key!r}"
        yield INTERLEAVED, SwigluOAIAndMul(VLLM_ALPHA, VLLM_LIMIT).forward_native


LOADER = """
    # the interleaved experts' stacked tensors, as the source holds them ([experts,
    # hidden, 2 * intermediate], gate and up alternating; biases) -> vLLM's fused MoE
    # layer, one expert at a time through its own loader for this layout, which takes
    # this rank's share of the interleaved rows (or, under expert parallelism, its
    # experts) and transposes them
    interleaved_experts = {table}

    def _interleaved_experts(self, weights, loaded: set[str]):
        for name, tensor in weights:
            owner, _, param_name = name.rpartition(".")
            target = self.interleaved_experts.get(param_name)
            if target is None or not owner.endswith(".experts"):
                yield name, tensor
                continue
            try:
                layer = self.get_submodule(owner)
            except AttributeError:  # a layer of another pipeline stage
                continue
            param = getattr(layer.routed_experts, target[0])
            for expert, one in enumerate(tensor):
                param.weight_loader(
                    param,
                    one,
                    weight_name=f"{{owner}}.routed_experts.{{target[0]}}",
                    shard_id=target[1],
                    expert_id=expert,
                    return_success=True,
                )
            loaded.add(f"{{owner}}.routed_experts.{{target[0]}}")
"""


def _shape(info, attr: str) -> list[cst.BaseExpression] | None:
    value = info.attrs.get(attr)
    if not m.matches(value, _PARAMETER):
        return None
    args = [a.value for a in value.args[0].value.args]
    if len(args) == 1 and isinstance(args[0], cst.Tuple):  # torch.empty((E, I, H))
        args = [e.value for e in args[0].elements]
    return args


def match(info, classes=None) -> TransposedExperts | None:
    """The form, if `__init__` builds two 3-D parameters, the gate/up one `2 * <size>`
    wide in its last dim, and biases `[E, 2I]` / `[E, H]` beside them."""
    if info.forward is None:
        return None
    shapes = {a: s for a in info.attrs if (s := _shape(info, a)) is not None}
    three = {a: s for a, s in shapes.items() if len(s) == 3}
    if len(three) != 2:
        return None
    wide = [a for a, s in three.items() if m.matches(s[2], _DOUBLE)]
    if len(wide) != 1:
        return None
    gate_up = wide[0]
    down = next(a for a in three if a != gate_up)
    e, h, two_i = three[gate_up]
    d = three[down]
    if [code(x) for x in d] != [code(e), code(two_i.right), code(h)]:
        return None  # not [E, I, H] beside [E, H, 2I]
    two = {a: s for a, s in shapes.items() if len(s) == 2 and code(s[0]) == code(e)}
    gu_bias = [a for a, s in two.items() if code(s[1]) == code(two_i)]
    d_bias = [a for a, s in two.items() if code(s[1]) == code(h)]
    if len(gu_bias) > 1 or len(d_bias) > 1:
        return None
    acts = [v for v in info.attrs.values() if m.matches(v, ACT2FN_LOOKUP)]
    return TransposedExperts(
        class_name=info.name,
        gate_up=gate_up,
        down=down,
        gate_up_bias=gu_bias[0] if gu_bias else None,
        down_bias=d_bias[0] if d_bias else None,
        num_experts=e,
        hidden=h,
        intermediate=two_i.right,
        act_name=acts[0].slice[0].slice.value if len(acts) == 1 else None,
    )


def _fixed_fields(info, module, run) -> tuple[tuple[str, float], ...]:
    """The config fields the module reads as numbers that change its output
    (`self.alpha = config.swiglu_alpha`), at their tiny values, which must be vLLM's
    constants. `run()`: the module's output on fixed inputs past the clamp."""
    import torch

    base = run()
    fixed = []
    for attr, value in info.attrs.items():
        if not m.matches(value, m.Attribute(value=m.Name("config"))):
            continue
        current = getattr(module, attr, None)
        if type(current) is not float:
            continue
        setattr(module, attr, current * 1.25 + 0.5)
        try:
            moved = run()
        finally:
            setattr(module, attr, current)
        if not torch.equal(moved, base):
            fixed.append((value.attr.value, current))
    for field, current in fixed:
        if current not in (VLLM_ALPHA, VLLM_LIMIT):
            raise PatternRefused(
                f"config.{field} = {current}: vLLM's fused {SWIGLUOAI} computes alpha "
                f"{VLLM_ALPHA} and limit {VLLM_LIMIT} only"
            )
    return tuple(fixed)
