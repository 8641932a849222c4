"""transformers' activations picked by name -> vLLM's op for the same function.

`self.act = ACT2FN[config.activation_function]` (or `get_activation(...)`) builds
transformers' class for a name only the checkpoint's config holds. Some are written as
several element-wise ops, each a pass over the MLP's widest tensor (`gelu_new`, GPT-2's:
the tanh approximation of GELU in seven) where one of vLLM's activations computes the
same function in one kernel. The name is known only when the module is built, so the
file builds through `act_fn(name)`: vLLM's op for each name the proof mapped when the
file was generated, transformers' own class for every other name. The proof runs
transformers' class for each name it knows against each of vLLM's activations, with
the activation pattern's inputs and tolerance (so `gelu` stays the erf form and
`gelu_new` the tanh approximation).
"""

from __future__ import annotations

import contextlib
import functools
import io

import libcst as cst
import libcst.matchers as m

from .activation import CANDIDATES, RTOL, difference, random_inputs
from .base import Claim, FusionRecord, Pattern, REWRITE, code, dotted_name

NAME = "activation by name"
LOOKUP = m.Subscript(value=m.Name("ACT2FN")) | m.Call(
    func=m.Name("get_activation"), args=[m.Arg(keyword=None)]
)


@functools.cache
def vllm_names() -> tuple[tuple[str, str], ...]:
    """(transformers' name, vLLM's activation computing its function) for every name
    transformers knows whose class holds no parameters and one of vLLM's ops matches."""
    import vllm._custom_ops  # noqa: F401 - registers the kernels vLLM's ops call
    from transformers.activations import ACT2CLS, ACT2FN
    from vllm.model_executor.layers.activation import get_act_fn

    xs = random_inputs()
    ops = {name: get_act_fn(name) for name in CANDIDATES}
    out = []
    for name in sorted(ACT2CLS):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # xIELU's install hint
                theirs = ACT2FN[name]
        except Exception:  # noqa: BLE001 - a class that needs arguments: its own
            continue
        if any(True for _ in theirs.parameters()):
            continue  # learned (PReLU, xIELU): not a fixed function
        for vllm_name in CANDIDATES:
            if difference(theirs, ops[vllm_name], xs) <= RTOL:
                out.append((name, vllm_name))
                break
    return tuple(out)


def helper() -> str:
    table = "\n".join(f'    "{a}": "{b}",' for a, b in vllm_names())
    return f'''
# transformers' activation names -> the vLLM activation computing the same function
# (within fp32 rounding on inputs from -30 to 30, proven when this file was generated)
VLLM_ACTIVATIONS = {{
{table}
}}


def act_fn(name) -> nn.Module:
    """transformers' `ACT2FN[name]`, as vLLM's op where one computes its function."""
    if isinstance(name, str) and name in VLLM_ACTIVATIONS:
        return get_act_fn(VLLM_ACTIVATIONS[name])
    return ACT2FN[name]
'''


def _name_expr(node: cst.BaseExpression) -> cst.BaseExpression:
    if isinstance(node, cst.Subscript):
        return node.slice[0].slice.value
    return node.args[0].value


class ActivationNames(Pattern):
    """Each `ACT2FN[<name>]` / `get_activation(<name>)` in a copied class's
    `__init__` becomes `act_fn(<name>)`."""

    name = NAME

    def claim(self, model):
        copied = [o for o in model.roles.wanted if not model.claimed_whole(o)]
        for n in copied:
            info = model.classes[n]
            if info.init is None or not _built_by_a_copy(model, n, copied):
                continue
            found = [
                (attr, value)
                for attr, values in info.choices.items()
                for value in values
                if m.matches(value, LOOKUP)
            ]
            if not found or not vllm_names():
                continue
            mapped = len(vllm_names())
            records = [
                FusionRecord(
                    pattern=NAME,
                    source_class=n,
                    sources=(code(value),),
                    target=attr,
                    vllm_class=f"act_fn({code(_name_expr(value))})",
                    detail=f"vLLM's op for the {mapped} names one computes",
                )
                for attr, value in found
            ]
            yield Claim(self, n, None, REWRITE, records=list(dict.fromkeys(records)))

    def rewrite_class(self, claim: Claim, node: cst.ClassDef) -> cst.ClassDef:
        return node.visit(_ByName())

    def helpers(self, claim: Claim) -> tuple[str, ...]:
        return (helper(),)


def _built_by_a_copy(model, n: str, copied: list[str]) -> bool:
    """The causal LM, or a class some copied class builds: one built only inside a
    class a pattern emits whole (a MoE block's experts) is not in the file."""
    if n == model.roles.causal.name:
        return True
    return any(
        dotted_name(c.func) == n
        for o in copied
        if o != n
        for c in m.findall(model.classes[o].node, m.Call())
    )


class _ByName(cst.CSTTransformer):
    def leave_FunctionDef(self, original, updated):
        if updated.name.value != "__init__":
            return updated
        return updated.visit(_Lookups())


class _Lookups(cst.CSTTransformer):
    def leave_Subscript(self, original, updated):
        return self._act_fn(updated)

    def leave_Call(self, original, updated):
        return self._act_fn(updated)

    def _act_fn(self, node):
        if not m.matches(node, LOOKUP):
            return node
        return cst.Call(func=cst.Name("act_fn"), args=[cst.Arg(_name_expr(node))])
