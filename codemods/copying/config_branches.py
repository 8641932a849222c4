"""Weights read on a branch the config decides: vLLM's linears, the branch checked when
the module is built.

BLOOM's `if self.pretraining_tp > 1 and self.slow_but_exact:` sums `F.linear` over
slices of `self.dense.weight` (and drops its bias); otherwise it calls `self.dense`.
Read anywhere, a weight keeps its linear a plain torch layer: replicated under tensor
parallelism, never quantized, slower than vLLM's on CPU. But this test reads only
attributes `__init__` set from the config and constants: a checkpoint either takes the
branch or never does. So the linear is vLLM's, the branch stays as the source writes
it, and `__init__` ends with the branch's test: a config that takes it is served where
the weight is whole and unquantized (tensor parallel size 1, no quantization; there a
vLLM linear holds the very tensor the source slices), refused in one line elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, ParentNodeProvider

from fusion_patterns.base import ClassInfo, code

# calls a config-decided value may go through (`getattr(config, "x", 1)`)
PURE_BUILTINS = {"getattr", "int", "float", "bool", "len", "min", "max", "isinstance"}
WEIGHT_READ = m.Attribute(
    value=m.Attribute(value=m.Name("self"), attr=m.Name()),
    attr=m.Name("weight") | m.Name("bias"),
)

HELPER = '''
def source_layers_for(module: nn.Module, branch: str, quant_config) -> None:
    """This config takes the source's branch `branch`, which reads weights as tensors:
    the module holds the source's own layers for them (torch layers, whole, not
    quantized), and its other linears must be whole too."""
    tp_size = get_tensor_model_parallel_world_size()
    sharded = [
        name
        for name, layer in module.named_children()
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear))
    ]
    if (sharded and tp_size > 1) or quant_config is not None:
        raise ValueError(
            f"{type(module).__name__}: this config takes the source's branch "
            f"`{branch}`, which reads weights as tensors: served at tensor parallel "
            f"size 1 without quantization only (here: tensor parallel size {tp_size}, "
            f"quantization {quant_config})"
        )
'''


@dataclass(frozen=True)
class BranchRead:
    """Linears whose weights one class reads only on a branch its config decides."""

    test: str  # the condition under which they are read, as the source writes it
    init_test: str  # the same read from the config, as `__init__` can test it
    attrs: tuple[str, ...]

    def guard_lines(self) -> list[str]:
        return [
            "# the source's forward reads weights as tensors where the config says so",
            f"if {self.test}:",
            f"    source_layers_for(self, {self.test!r}, quant_config)",
        ]

    def describe(self) -> str:
        names = ", ".join(self.attrs)
        return (
            f"`{self.test}` reads {names} as weights: vLLM's linears, the source's own "
            "torch layers for a config taking that branch (served at tensor parallel "
            "size 1 without quantization, refused when the module is built elsewhere)"
        )


class _FromConfig(cst.CSTTransformer):
    """`self.<attr>` -> the expression `__init__` set it from, until only the config
    and constants are read."""

    def __init__(self, values: dict[str, cst.BaseExpression]):
        self.values = values

    def leave_Attribute(self, original, updated):
        if (
            m.matches(updated.value, m.Name("self"))
            and updated.attr.value in self.values
        ):
            value = self.values[updated.attr.value].visit(self)
            return (
                value.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
                if not isinstance(value, (cst.Name, cst.Attribute))
                else value
            )
        return updated


def _config_values(info: ClassInfo) -> dict[str, cst.BaseExpression]:
    """{`self.<attr>` `__init__` sets, once in the class, from the config and constants
    only (`self.pretraining_tp = config.pretraining_tp`): its expression}."""
    if info.init is None:
        return {}
    assigned: dict[str, list[cst.BaseExpression]] = {}
    for node in m.findall(info.node, m.Assign() | m.AugAssign() | m.AnnAssign()):
        targets = (
            [t.target for t in node.targets]
            if isinstance(node, cst.Assign)
            else [node.target]
        )
        for t in targets:
            for attr in m.findall(t, m.Attribute(value=m.Name("self"))):
                value = node.value if isinstance(node, cst.Assign) else None
                assigned.setdefault(attr.attr.value, []).append(value)
    init_assigns = {
        a.attr.value
        for node in m.findall(info.init, m.Assign())
        for t in node.targets
        for a in [t.target]
        if m.matches(a, m.Attribute(value=m.Name("self")))
    }
    values: dict[str, cst.BaseExpression] = {}
    changed = True
    while changed:  # `self.a = self.b > 1` after `self.b = config.b`
        changed = False
        for attr, exprs in assigned.items():
            if (
                attr not in values
                and attr in init_assigns
                and len(exprs) == 1
                and exprs[0] is not None
                and _decided(exprs[0], values, names={"config"})
            ):
                values[attr] = exprs[0]
                changed = True
    return values


def _decided(expr: cst.BaseExpression, values, names=frozenset()) -> bool:
    """Whether `expr` reads only constants, `names` (and their attributes), the
    attributes in `values`, and pure builtins of those."""
    if isinstance(expr, (cst.Integer, cst.Float, cst.SimpleString)):
        return True
    if isinstance(expr, cst.Name):
        return expr.value in {"True", "False", "None", *names}
    if isinstance(expr, cst.Attribute):
        if m.matches(expr.value, m.Name("self")):
            return expr.attr.value in values
        return _decided(expr.value, values, names)
    if isinstance(expr, (cst.Comparison,)):
        return _decided(expr.left, values, names) and all(
            _decided(t.comparator, values, names) for t in expr.comparisons
        )
    if isinstance(expr, (cst.BooleanOperation, cst.BinaryOperation)):
        return _decided(expr.left, values, names) and _decided(
            expr.right, values, names
        )
    if isinstance(expr, cst.UnaryOperation):
        return _decided(expr.expression, values, names)
    if isinstance(expr, (cst.Tuple, cst.List)):
        return all(_decided(e.value, values, names) for e in expr.elements)
    if isinstance(expr, cst.Call):
        return (
            m.matches(expr.func, m.Name())
            and expr.func.value in PURE_BUILTINS
            and all(_decided(a.value, values, names) for a in expr.args)
        )
    return False


def _branch_of(node, parents, values) -> cst.BaseExpression | None:
    """The test of the nearest `if` around `node` the config decides (`not (...)` on
    its else side); None when there is none."""
    child, parent = node, parents.get(node)
    while parent is not None and not isinstance(parent, cst.FunctionDef):
        if isinstance(parent, cst.If) and child is not parent.test:
            if _decided(parent.test, values):
                if child is parent.body:
                    return parent.test
                return cst.UnaryOperation(
                    cst.Not(),
                    parent.test.with_changes(
                        lpar=[cst.LeftParen()], rpar=[cst.RightParen()]
                    ),
                )
        child, parent = parent, parents.get(parent)
    return None


def linear_reads(
    module: cst.Module, classes: dict[str, ClassInfo], wanted=None
) -> tuple[set[str], dict[str, BranchRead]]:
    """Attribute names whose `.weight` or `.bias` the source reads somewhere it is
    copied from (not the PreTrainedModel classes, whose weight init is not copied, nor
    a class the generated file does not hold, such as a flash-attention variant): those
    kept as torch layers, and {class: its reads on branches its config decides} of the
    others."""
    from .classes import is_pretrained

    kept: set[str] = set()
    branched: dict[str, BranchRead] = {}
    for node in module.body:
        if not isinstance(node, cst.ClassDef) or node.name.value not in classes:
            continue
        if is_pretrained(node, classes) or (
            wanted is not None and node.name.value not in wanted
        ):
            continue
        anywhere, on_branch = _weight_reads(classes[node.name.value])
        kept |= anywhere
        if on_branch is not None:
            branched[node.name.value] = on_branch
    return kept, {n: b for n, b in branched.items() if not set(b.attrs) & kept}


def _weight_reads(info: ClassInfo) -> tuple[set[str], BranchRead | None]:
    """The linears `info` reads as weights anywhere (kept as torch layers) and those it
    reads only on branches its config decides (one guard per class: their tests
    joined)."""
    values = _config_values(info)
    wrapper = MetadataWrapper(cst.Module(body=[info.node]), unsafe_skip_copy=True)
    parents = wrapper.resolve(ParentNodeProvider)
    anywhere: set[str] = set()
    branched: dict[str, list[cst.BaseExpression]] = {}
    for read in m.findall(wrapper.module, WEIGHT_READ):
        attr = read.value.attr.value
        test = _branch_of(read, parents, values)
        if test is None:
            anywhere.add(attr)
        else:
            branched.setdefault(attr, []).append(test)
    branched = {a: t for a, t in branched.items() if a not in anywhere}
    if not branched:
        return anywhere, None
    tests = {code(t): t for ts in branched.values() for t in ts}
    joined = list(tests.values())[0]
    for t in list(tests.values())[1:]:
        joined = cst.BooleanOperation(joined, cst.Or(), t)
    from_config = joined.visit(_FromConfig(values))
    return anywhere, BranchRead(
        code(joined), code(from_config), tuple(sorted(branched))
    )


@dataclass(frozen=True)
class DecidedBranch:
    """One test in a method but `__init__` that reads only the config and constants."""

    config: str  # read from the config as `__init__` can test it (`config.multi_query`)
    taken: bool  # the way the instance it was read on takes it

    def text(self, taken: bool | None = None) -> str:
        taken = self.taken if taken is None else taken
        return self.config if taken else negated(self.config)


_NEGATED = {
    cst.Is: cst.IsNot,
    cst.IsNot: cst.Is,
    cst.Equal: cst.NotEqual,
    cst.NotEqual: cst.Equal,
}


def negated(test: str) -> str:
    """`not test`, written as the source would (`x is not None` for `not (x is None)`)."""
    expr = cst.parse_expression(test)
    if m.matches(expr, m.UnaryOperation(operator=m.Not())):
        return code(expr.expression.with_changes(lpar=[], rpar=[]))
    if isinstance(expr, cst.Comparison) and len(expr.comparisons) == 1:
        (target,) = expr.comparisons
        if type(target.operator) in _NEGATED:
            flipped = _NEGATED[type(target.operator)]()
            return code(
                expr.with_changes(comparisons=[target.with_changes(operator=flipped)])
            )
    if isinstance(expr, (cst.Name, cst.Attribute)):
        return f"not {test}"
    return f"not {test}" if expr.lpar else f"not ({test})"


def decided_branches(info: ClassInfo, instance) -> list[DecidedBranch] | None:
    """The branches the config decides in `info`'s methods but `__init__` (`if
    self.multi_query:` in forward, Falcon's layouts in `_split_heads`), each with the
    way `instance`, built from the tiny config, takes it; None where one cannot be
    evaluated on it."""
    values = _config_values(info)
    methods = [
        f
        for f in m.findall(info.node.body, m.FunctionDef())
        if f.name.value != "__init__"
    ]
    found: dict[str, DecidedBranch] = {}
    ifs = [n for f in methods for n in m.findall(f, m.If() | m.IfExp())]
    for node in ifs:
        if not _decided(node.test, values):
            continue
        try:
            taken = bool(eval(code(node.test), {"self": instance}))  # noqa: S307
        except Exception:  # noqa: BLE001 - an attribute the instance lacks
            return None
        read = node.test.visit(_FromConfig(values))
        if not taken and m.matches(read, m.UnaryOperation(operator=m.Not())):
            read, taken = read.expression, True  # `not (not x)`: x
        text = code(read.with_changes(lpar=[], rpar=[]))
        if not isinstance(read, (cst.Name, cst.Attribute)):
            text = f"({text})"
        found.setdefault(text, DecidedBranch(text, taken))
    return list(found.values())
