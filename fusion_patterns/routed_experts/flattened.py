"""Experts held by a child module as three matrices of every expert stacked along their
rows, [experts * intermediate, hidden] each (DBRX's `mlp.w1`, `mlp.v1`, `mlp.w2`), one
activated gate, one up, one down. Which matrix plays which part, and whether the down
one is applied as `h @ W_e` or `h @ W_e.T`, is the proof's finding: every assignment
is tried against vLLM's fused form written out, on random weights and routings; the
activation is the child's `ACT2FN[...]` one, which vLLM's fused MoE must have.

Loaded by splitting each stacked matrix into its experts, under the per-expert names
vLLM's fused MoE loader reads (`experts.<e>.gate_proj.weight`, ...), which then takes
this rank's share as for any checkpoint of per-expert tensors."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import libcst as cst
import libcst.matchers as m

from ..base import LoaderHook, PatternRefused, code
from ..moe.match import ACT2FN_LOOKUP, resolve
from ..moe.proof import evaluate, experts_reference

_FLAT = m.Call(
    func=m.Attribute(value=m.Name("nn"), attr=m.Name("Parameter"))
    | m.Name("Parameter"),
    args=[
        m.Arg(
            m.Call(
                func=m.Attribute(
                    value=m.Name("torch"), attr=m.Name("empty") | m.Name("zeros")
                ),
                args=[
                    m.Arg(m.BinaryOperation(operator=m.Multiply())),
                    m.Arg(),
                ],
            )
        ),
        m.ZeroOrMore(),
    ],
)
# the names vLLM's fused MoE loader reads one expert's tensors under
VLLM_NAMES = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class FlattenedExperts:
    class_name: str
    child: str  # the attribute holding the matrices
    params: tuple[str, str, str]  # the child's three stacked matrices, in source order
    num_experts: cst.BaseExpression  # over the experts' own constructor parameters
    intermediate: cst.BaseExpression
    hidden: cst.BaseExpression
    act_name: cst.BaseExpression
    # the proof's finding: {part: matrix} and whether down is applied as h @ W_e
    roles: tuple[tuple[str, str], ...] = ()
    down_as_rows: bool = False

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(f"{self.child}.{p}" for p in self.params)

    stacked = None  # the hook below splits them; vLLM's loader reads the experts

    def factory_args(self, info) -> dict[str, object]:
        return {
            "num_experts": self.num_experts,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "activation": self.act_name,
        }

    def guards(self) -> list[str]:
        return []

    def loader(self) -> LoaderHook:
        parts = {matrix: VLLM_NAMES[part] for part, matrix in self.roles}
        return LoaderHook(
            LOADER.format(
                child=self.child,
                parts=repr(parts),
                down=dict(self.roles)["down"],
                transpose="tensor.transpose(1, 2)" if self.down_as_rows else "tensor",
            ),
            "self._flattened_experts({weights})",
        )

    def prove(self, config, info, module, check) -> "FlattenedExperts":
        import torch

        from vllm.model_executor.layers.activation import get_act_and_mul_fn
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        key = str(evaluate(self.act_name, config, "the activation"))
        try:
            MoEActivation.from_str(key)
            act_and_mul = get_act_and_mul_fn(key).forward_native
        except ValueError:
            raise PatternRefused(
                f"vLLM's fused MoE has no activation {key!r}"
            ) from None
        child = getattr(module, self.child)
        known = {f"{self.child}.{p}" for p in self.params}
        extra = [n for n, _ in module.named_parameters() if n not in known]
        if extra:
            raise PatternRefused(f"they also hold {', '.join(extra)}")
        experts, inter, hidden = (
            int(evaluate(e, config, "an experts size"))
            for e in (self.num_experts, self.intermediate, self.hidden)
        )
        mats = {p: getattr(child, p) for p in self.params}
        if any(tuple(t.shape) != (experts * inter, hidden) for t in mats.values()):
            raise PatternRefused(
                f"their matrices are not [{experts} * {inter}, {hidden}] as the config "
                "sizes them"
            )
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for t in mats.values():
                t.copy_(torch.randn(t.shape, generator=gen) / hidden**0.5)
        per_expert = {p: t.view(experts, inter, hidden) for p, t in mats.items()}
        why = None
        for gate, up, down in itertools.permutations(self.params):
            for rows in (True, False):
                w13 = torch.cat([per_expert[gate], per_expert[up]], dim=1)
                w2 = per_expert[down]
                w2 = w2.transpose(1, 2) if rows else w2.reshape(experts, hidden, inter)

                def reference(x, chosen, w, w13=w13, w2=w2):
                    return experts_reference(x, chosen, w, w13, w2, act_and_mul)

                try:
                    check(reference, hidden, experts)
                except PatternRefused as exc:
                    why = why or exc
                    continue
                roles = (("gate", gate), ("up", up), ("down", down))
                return replace(self, roles=roles, down_as_rows=rows)
        raise PatternRefused(f"no assignment of their matrices computes them ({why})")


LOADER = """
    # the experts' matrices, each every expert's stacked along its rows as the source
    # holds them ([experts * intermediate, hidden], in self.{child}) -> one tensor per
    # expert under the names vLLM's fused MoE loader reads, which takes this rank's share
    flattened_experts = {parts}

    def _flattened_experts(self, weights):
        for name, tensor in weights:
            owner, _, matrix = name.rpartition(".{child}.")
            target = self.flattened_experts.get(matrix)
            if target is None or not owner.endswith(".experts"):
                yield name, tensor
                continue
            try:
                layer = self.get_submodule(owner)
            except AttributeError:  # a layer of another pipeline stage
                continue
            experts = layer.routed_experts.moe_config.num_logical_experts
            tensor = tensor.view(experts, -1, tensor.shape[-1])
            if matrix == "{down}":  # vLLM holds down as [hidden, intermediate]
                tensor = {transpose}
            for expert, one in enumerate(tensor):
                yield f"{{owner}}.{{expert}}.{{target}}.weight", one
"""


def match(info, classes=None) -> FlattenedExperts | None:
    """The form, if the class holds one child module (a source class) whose `__init__`
    builds three `[<a> * <b>, <c>]` parameters of one shape and an `ACT2FN[...]`
    activation."""
    if info.forward is None or classes is None:
        return None
    for attr, value in info.attrs.items():
        child = classes.get(info.constructed_class(attr) or "")
        if child is None or child.init is None:
            continue
        flat = {a: v for a, v in child.attrs.items() if m.matches(v, _FLAT)}
        shapes = {code(v.args[0].value) for v in flat.values()}
        if len(flat) != 3 or len(shapes) != 1:
            continue
        rows, cols = (a.value for a in next(iter(flat.values())).args[0].value.args)
        act = _activation(child)
        if act is None:
            return None
        call = info.attrs[attr]
        args = _bound(child, call)
        return FlattenedExperts(
            class_name=info.name,
            child=attr,
            params=tuple(flat),
            num_experts=resolve(resolve(rows.left, child, args), info, {}),
            intermediate=resolve(resolve(rows.right, child, args), info, {}),
            hidden=resolve(resolve(cols, child, args), info, {}),
            act_name=resolve(resolve(act, child, args), info, {}),
        )
    return None


def _bound(child, call: cst.Call) -> dict[str, cst.BaseExpression]:
    """The child's constructor parameters -> the arguments the experts build it with."""
    names = [p.name.value for p in child.init.params.params if p.name.value != "self"]
    out = {}
    for i, arg in enumerate(call.args):
        if arg.keyword is not None:
            out[arg.keyword.value] = arg.value
        elif i < len(names):
            out[names[i]] = arg.value
    return out


def _activation(child) -> cst.BaseExpression | None:
    """The child's `ACT2FN[<key>]` key, a local of `__init__` replaced by its value
    (DBRX: `act_fn_name = config.ffn_act_fn.get("name", "silu")`)."""
    acts = [v for v in child.attrs.values() if m.matches(v, ACT2FN_LOOKUP)]
    if len(acts) != 1:
        return None
    key = acts[0].slice[0].slice.value
    if isinstance(key, cst.Name):
        local = [
            a.value
            for a in m.findall(
                child.init, m.Assign(targets=[m.AssignTarget(m.Name(key.value))])
            )
        ]
        if len(local) != 1:
            return None
        key = local[0]
    return key
