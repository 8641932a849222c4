"""A layer list the base model builds in a method of its own (Zamba 2's `get_layers`:
a loop over the layer kinds, a hybrid layer made of modules built beside it, state
carried from one layer to the next), kept as the source's code but building nothing:
each module it would construct becomes a builder taking the prefix the module ends up
at, so vLLM's `make_layers` builds only this pipeline stage's layers, each under its
own path (its KV cache, its Mamba state, its checkpoint names).

- `x = Module(...)` -> `x = lambda prefix, <locals>: Module(..., prefix=prefix)`;
- `layers.append(Module(...))` -> `layers.append(lambda prefix, ...: Module(...))`;
- a built module handed to a layer (`Layer(x)`) -> `x(f"{prefix}.<attr>")`, the
  attribute the layer's `__init__` stores that argument as;
- `return nn.ModuleList(layers)` -> `return layers`, the builders.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, code, dotted_name, linear_args
from fusion_patterns.emitting import with_keyword

from ..copying.classes import LINEARS, Context
from ..errors import CodemodError

BUILDERS = "layer_builders"


def init_lines(method: cst.FunctionDef, attr: str) -> list[str]:
    """The base model's `self.<layers> = self.<method>()`, through `make_layers`."""
    return [
        f"{BUILDERS} = self.{method.name.value}(quant_config)",
        f"self.start_layer, self.end_layer, self.{attr} = make_layers(",
        f"    len({BUILDERS}),",
        f"    lambda prefix: {BUILDERS}[extract_layer_index(prefix)](prefix),",
        f'    prefix=f"{{prefix}}.{attr}",',
        ")",
    ]


def builder_method(method: cst.FunctionDef, ctx: Context) -> cst.FunctionDef:
    """The method, returning one builder per layer instead of the layers."""
    name = _list_name(method)
    assigned = _assigned_names(method)
    rewrite = _Builders(name, ctx, assigned)
    body = method.body.visit(rewrite)
    _refuse_other_uses(body, rewrite.built, method.name.value)
    params = method.params.with_changes(
        params=[*method.params.params, cst.Param(cst.Name("quant_config"))]
    )
    return method.with_changes(body=body, params=params, decorators=[])


def _assigned_names(method: cst.FunctionDef) -> set[str]:
    """Names the method binds (its locals and loop variables), which a builder made in
    a loop binds as it is at that iteration."""
    out = set()
    for node in m.findall(method.body, m.AssignTarget() | m.For() | m.AugAssign()):
        target = node.target
        names = [target] if isinstance(target, cst.Name) else []
        if isinstance(target, cst.Tuple):
            names = [e.value for e in target.elements]
        out |= {n.value for n in names if isinstance(n, cst.Name)}
    return out


def _list_name(method: cst.FunctionDef) -> str:
    returned = m.findall(
        method.body,
        m.Return(
            m.Call(func=m.Attribute(attr=m.Name("ModuleList")), args=[m.Arg(m.Name())])
        ),
    )
    if len(returned) != 1:
        raise CodemodError(
            f"cannot generate: {method.name.value} does not return one `nn.ModuleList(<layers>)`"
        )
    return returned[0].value.args[0].value.value


class _Builders(cst.CSTTransformer):
    def __init__(self, list_name: str, ctx: Context, assigned: set[str]):
        self.list_name, self.ctx, self.assigned = list_name, ctx, assigned
        self.built: set[str] = set()  # locals holding a builder

    def _is_module(self, node) -> bool:
        if not isinstance(node, cst.Call):
            return False
        func = dotted_name(node.func) or ""
        return func in self.ctx.classes or func.startswith(("nn.", "torch.nn."))

    def leave_Assign(self, original, updated):
        if (
            len(updated.targets) == 1
            and isinstance(updated.targets[0].target, cst.Name)
            and self._is_module(updated.value)
        ):
            self.built.add(updated.targets[0].target.value)
            return updated.with_changes(value=self._builder(updated.value))
        return updated

    def leave_Call(self, original, updated):
        if m.matches(
            updated.func,
            m.Attribute(value=m.Name(self.list_name), attr=m.Name("append")),
        ) and self._is_module(updated.args[0].value):
            arg = updated.args[0].with_changes(
                value=self._builder(updated.args[0].value)
            )
            return updated.with_changes(args=[arg])
        return updated

    def leave_Return(self, original, updated):
        return updated.with_changes(value=cst.Name(self.list_name))

    def _builder(self, call: cst.Call) -> cst.Lambda:
        built = self._built_call(call)
        free = [
            n
            for n in dict.fromkeys(x.value for x in m.findall(built, m.Name()))
            if n in self.assigned
        ]
        binds = "".join(f", {n}={n}" for n in free)
        return cst.parse_expression(f"lambda prefix{binds}: {code(built)}")

    def _built_call(self, call: cst.Call) -> cst.Call:
        func = dotted_name(call.func) or ""
        stored = _stored_params(self.ctx.classes.get(func))
        params = _param_names(self.ctx.classes.get(func))
        args = []
        for i, arg in enumerate(call.args):
            value = arg.value
            if isinstance(value, cst.Name) and value.value in self.built:
                param = (
                    arg.keyword.value
                    if arg.keyword
                    else (params[i] if i < len(params) else None)
                )
                if param not in stored:
                    raise CodemodError(
                        f"cannot generate: {func} is handed {value.value} as an argument it does not store"
                    )
                value = cst.parse_expression(
                    f'{value.value}(f"{{prefix}}.{stored[param]}")'
                )
            args.append(arg.with_changes(value=value))
        call = call.with_changes(args=args)
        if func in LINEARS:
            d_in, d_out, bias = linear_args(call)
            return cst.parse_expression(
                f"ReplicatedLinear({code(d_in)}, {code(d_out)}, bias={code(bias)}, "
                "return_bias=False, quant_config=quant_config, prefix=prefix)"
            )
        if func in self.ctx.prefix_classes:
            call = with_keyword(call, "quant_config", "quant_config")
            call = with_keyword(call, "prefix", "prefix")
        return call


def _param_names(info: ClassInfo | None) -> list[str]:
    if info is None or info.init is None:
        return []
    return [p.name.value for p in info.init.params.params][1:]


def _stored_params(info: ClassInfo | None) -> dict[str, str]:
    """{parameter: attribute} of `self.<attribute> = <parameter>` in `__init__`."""
    if info is None:
        return {}
    params = set(_param_names(info))
    return {
        value.value: attr
        for attr, value in info.attrs.items()
        if isinstance(value, cst.Name) and value.value in params
    }


def _refuse_other_uses(body: cst.CSTNode, built: set[str], method: str) -> None:
    """A built module read anywhere but as a builder (called with its prefix, handed
    on, bound into another builder) would be a function where a module was."""
    for name in sorted(built):
        uses = len(m.findall(body, m.Name(name)))
        allowed = (
            len(m.findall(body, m.AssignTarget(m.Name(name))))
            + len(m.findall(body, m.Call(func=m.Name(name))))
            + 2 * len(m.findall(body, m.Param(m.Name(name), default=m.Name(name))))
            + len(
                m.findall(
                    body,
                    m.Call(
                        func=m.Attribute(attr=m.Name("append")),
                        args=[m.Arg(m.Name(name))],
                    ),
                )
            )
        )
        if uses != allowed:
            raise CodemodError(
                f"cannot generate: {method} uses the module it builds as {name} besides building a layer from it"
            )
