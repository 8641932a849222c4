"""What is known when vLLM runs a model, folded into the source so dead paths disappear.

Under vLLM a transformers module never trains, keeps no cache of its own (the paged KV
cache lives in vLLM's `Attention`), returns no attention weights or hidden-state
tuples, and is never cross-attending. Those facts are substituted into the copied
source (`self.training` -> `False`, `past_key_values` -> `None`, ...), then constant
tests are folded and the branches they decide are removed, so a reviewer reads the
path that runs, not the training or cache paths around it.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

# Parameters of a transformers forward that carry nothing under vLLM: dropped from the
# copied signatures and from calls, their uses replaced by the value they always have.
INFERENCE_PARAMS: dict[str, str] = {
    "past_key_values": "None",
    "past_key_value": "None",
    "layer_past": "None",
    "use_cache": "False",
    "output_attentions": "False",
    "output_hidden_states": "False",
    "output_router_logits": "False",
    "return_dict": "True",
    "head_mask": "None",
    "encoder_hidden_states": "None",
    "encoder_attention_mask": "None",
    "key_value_states": "None",
    "cross_attn_head_mask": "None",
    "labels": "None",
    "logits_to_keep": "0",
    "num_logits_to_keep": "0",
}
# `self.<attr>` that is constant at inference
SELF_FACTS = {"training": "False", "gradient_checkpointing": "False"}
# the attention implementation the copied code runs under: none of transformers' own
ATTN_IMPLEMENTATION = '"vllm"'
# helpers whose answer is fixed under vLLM
CALL_FACTS = {
    "is_flash_attention_requested": "False",
    "is_torch_flex_attn_available": "False",
}

_TRUE, _FALSE, _NONE = cst.Name("True"), cst.Name("False"), cst.Name("None")


def _const(node: cst.BaseExpression):
    """The Python value of a literal node (True/False/None/str/int), or a sentinel."""
    if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[node.value]
    if isinstance(node, cst.SimpleString):
        return node.evaluated_value
    if isinstance(node, cst.Integer):
        return int(node.value)
    if isinstance(node, cst.Float):
        return float(node.value)
    if isinstance(node, (cst.Tuple, cst.List, cst.Set)):
        values = [_const(e.value) for e in node.elements if isinstance(e, cst.Element)]
        if len(values) == len(node.elements) and _UNKNOWN not in values:
            return tuple(values)
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        inner = _const(node.expression)
        if isinstance(inner, (int, float)) and not isinstance(inner, bool):
            return -inner
    return _UNKNOWN


_UNKNOWN = object()


def _literal(value) -> cst.BaseExpression:
    return cst.parse_expression(repr(value))


def is_constant(node: cst.BaseExpression) -> bool:
    return _const(node) is not _UNKNOWN


class Fold(cst.CSTTransformer):
    """Substitute known names, then fold constant expressions and prune decided branches.

    `known`: names whose loads become the given expression; `not_none`: names known to
    hold a value (so `x is None` is False)."""

    def __init__(
        self,
        known: dict[str, str] | None = None,
        not_none: set[str] | frozenset = frozenset(),
    ):
        self.known = {k: cst.parse_expression(v) for k, v in (known or {}).items()}
        self.not_none = set(not_none)
        self._not_loads: set[int] | None = None

    # --- substitutions ------------------------------------------------------------
    def on_visit(self, node: cst.CSTNode) -> bool:
        if self._not_loads is None:
            self._not_loads = not_loads(node)
        return super().on_visit(node)

    def leave_Name(self, original: cst.Name, updated: cst.Name):
        if id(original) in self._not_loads:
            return updated
        return self.known.get(original.value, updated)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        if m.matches(updated, m.Attribute(value=m.Name("self"))):
            fact = SELF_FACTS.get(updated.attr.value)
            if fact is not None:
                return cst.parse_expression(fact)
        if updated.attr.value == "_attn_implementation":
            return cst.parse_expression(ATTN_IMPLEMENTATION)
        return updated

    def leave_Subscript(self, original, updated: cst.Subscript):
        # an indexed mask that is now None (`mask[:, :, :n]`)
        if m.matches(updated.value, m.Name("None")):
            return _NONE
        return updated

    def leave_Call(self, original: cst.Call, updated: cst.Call):
        # a method of a folded None (`None.to(torch.bool)`): the mask it stood for is gone
        if m.matches(updated.func, m.Attribute(value=m.Name("None"))):
            return _NONE
        if isinstance(updated.func, cst.Name) and updated.func.value in CALL_FACTS:
            return cst.parse_expression(CALL_FACTS[updated.func.value])
        # isinstance(0, int): a folded `logits_to_keep`
        if m.matches(
            updated,
            m.Call(
                func=m.Name("isinstance"),
                args=[m.Arg(m.Integer()), m.Arg(m.Name("int"))],
            ),
        ):
            return _TRUE
        # isinstance(<literal>, ...) of a folded value
        if m.matches(updated, m.Call(func=m.Name("isinstance"))) and updated.args:
            first = updated.args[0].value
            if isinstance(first, cst.NamedExpr):
                first = first.value
            if _const(first) is None and isinstance(first, cst.Name):
                target = updated.args[1].value if len(updated.args) > 1 else None
                if target is not None and not m.findall(target, m.Name("NoneType")):
                    return _FALSE
        return updated

    # --- expressions --------------------------------------------------------------
    def leave_Comparison(self, original, updated: cst.Comparison):
        if len(updated.comparisons) != 1:
            return updated
        comp = updated.comparisons[0]
        left, right, op = updated.left, comp.comparator, comp.operator
        if isinstance(op, (cst.Is, cst.IsNot)) and _const(right) is None:
            value = _const(left)
            if value is _UNKNOWN:
                if isinstance(left, cst.Name) and left.value in self.not_none:
                    return _TRUE if isinstance(op, cst.IsNot) else _FALSE
                return updated
            is_none = value is None
            return _TRUE if is_none == isinstance(op, cst.Is) else _FALSE
        a, b = _const(left), _const(right)
        if a is _UNKNOWN or b is _UNKNOWN:
            return updated
        try:
            if isinstance(op, cst.Equal):
                return _TRUE if a == b else _FALSE
            if isinstance(op, cst.NotEqual):
                return _TRUE if a != b else _FALSE
            if isinstance(op, cst.In) and isinstance(b, tuple):
                return _TRUE if a in b else _FALSE
            if isinstance(op, cst.NotIn) and isinstance(b, tuple):
                return _TRUE if a not in b else _FALSE
        except TypeError:
            pass
        return updated

    def leave_UnaryOperation(self, original, updated: cst.UnaryOperation):
        if isinstance(updated.operator, cst.Not):
            value = _const(updated.expression)
            if value is not _UNKNOWN and isinstance(value, (bool, type(None))):
                return _FALSE if value else _TRUE
        return updated

    def leave_BooleanOperation(self, original, updated: cst.BooleanOperation):
        left = _const(updated.left)
        right = _const(updated.right)
        is_and = isinstance(updated.operator, cst.And)
        if left is not _UNKNOWN and isinstance(left, (bool, type(None))):
            if is_and:
                return updated.right if left else _literal(left)
            return _literal(left) if left else updated.right
        if right is not _UNKNOWN and isinstance(right, bool):
            # `x and False` is falsy whatever x is only when x has no side effect that
            # matters; the operands here are tests, kept when they call anything
            if not m.findall(updated.left, m.Call()):
                if is_and and not right:
                    return _FALSE
                if not is_and and right:
                    return _TRUE
            if is_and and right:
                return updated.left
            if not is_and and not right:
                return updated.left
        return updated

    def leave_IfExp(self, original, updated: cst.IfExp):
        value = _const(updated.test)
        if value is _UNKNOWN:
            return updated
        return updated.body if value else updated.orelse

    # --- statements ---------------------------------------------------------------
    def leave_If(self, original, updated: cst.If):
        value = _const(updated.test)
        if value is _UNKNOWN:
            return updated
        if value:
            return cst.FlattenSentinel(list(updated.body.body))
        orelse = updated.orelse
        if orelse is None:
            return cst.RemoveFromParent()
        if isinstance(orelse, cst.If):
            return orelse
        return cst.FlattenSentinel(list(orelse.body.body))

    def leave_IndentedBlock(self, original, updated: cst.IndentedBlock):
        body = list(updated.body)
        # statements after a return or raise never run
        for i, stmt in enumerate(body):
            if isinstance(stmt, cst.SimpleStatementLine) and any(
                isinstance(s, (cst.Return, cst.Raise)) for s in stmt.body
            ):
                body = body[: i + 1]
                break
        if not body:
            return updated.with_changes(body=[cst.SimpleStatementLine([cst.Pass()])])
        return updated.with_changes(body=body)


def loads(node: cst.CSTNode) -> list[str]:
    """Names read in `node` (an augmented assignment's target is read too)."""
    roles = _name_roles(node)
    return [
        n.value
        for n in roles.names
        if id(n) not in roles.not_loads or id(n) in roles.augmented
    ]


def stores(node: cst.CSTNode) -> set[str]:
    """Names bound in `node` (assignment, augmented assignment and loop targets)."""
    found = _Stores()
    node.visit(found)
    return found.names


class _Stores(cst.CSTVisitor):
    def __init__(self) -> None:
        self.names: set[str] = set()

    def visit_Assign(self, node: cst.Assign) -> None:
        for t in node.targets:
            self._target(t.target)

    def _single_target(self, node) -> None:
        self._target(node.target)

    visit_AugAssign = visit_AnnAssign = _single_target

    def _target(self, target: cst.BaseExpression) -> None:
        if isinstance(target, cst.Name):
            self.names.add(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            self.names |= {n.value for n in m.findall(target, m.Name())} - {
                a.attr.value for a in m.findall(target, m.Attribute())
            }

    def _loop_target(self, node) -> None:
        self.names |= {n.value for n in m.findall(node.target, m.Name())}

    visit_For = visit_CompFor = _loop_target


_PURE = (
    cst.Name,
    cst.Attribute,
    cst.SimpleString,
    cst.Integer,
    cst.Float,
    cst.Tuple,
    cst.List,
    cst.Dict,
    cst.Comparison,
    cst.BooleanOperation,
    cst.UnaryOperation,
    cst.IfExp,
    cst.Subscript,
    cst.BinaryOperation,
)


def _pure(node: cst.BaseExpression) -> bool:
    """No call anywhere in it: evaluating it has no effect beyond its value."""
    return isinstance(node, _PURE) and not m.findall(node, m.Call())


def _rebound(body: cst.CSTNode) -> set[str]:
    """Names assigned in `body` from an expression that does not read them
    (`x = x if x is not None else default` keeps x's meaning; `x = torch.ones(...)` does not).
    """
    out = set()
    for assign in m.findall(body, m.Assign() | m.AnnAssign() | m.AugAssign()):
        name = _single_name(assign) if not isinstance(assign, cst.AugAssign) else None
        if isinstance(assign, cst.AugAssign) and isinstance(assign.target, cst.Name):
            out.add(assign.target.value)
            continue
        if name is None:
            if isinstance(assign, cst.Assign):
                out |= stores(cst.SimpleStatementLine([assign]))
            continue
        if assign.value is None or not m.findall(assign.value, m.Name(name)):
            out.add(name)
    for loop in m.findall(body, m.For() | m.CompFor()):
        out |= {n.value for n in m.findall(loop.target, m.Name())}
    return out


class _DropDead(cst.CSTTransformer):
    def __init__(self, dead: set[str]):
        self.dead = dead

    def leave_SimpleStatementLine(self, original, updated):
        body = [
            s
            for s in updated.body
            if not (
                isinstance(s, (cst.Assign, cst.AnnAssign))
                and _single_name(s) in self.dead
                and (s.value is None or _pure(s.value))
            )
        ]
        if not body:
            return cst.RemoveFromParent()
        return updated.with_changes(body=body)

    def leave_IndentedBlock(self, original, updated):
        if not updated.body:
            return updated.with_changes(body=[cst.SimpleStatementLine([cst.Pass()])])
        return updated


def _single_name(stmt) -> str | None:
    if isinstance(stmt, cst.AnnAssign):
        return stmt.target.value if isinstance(stmt.target, cst.Name) else None
    if len(stmt.targets) == 1 and isinstance(stmt.targets[0].target, cst.Name):
        return stmt.targets[0].target.value
    return None


class Substitute(cst.CSTTransformer):
    """Each load of a name in `values` becomes its expression; keywords, attribute
    names and assignment targets stay (here: names assigned once to a literal and
    never rebound become the literal)."""

    def __init__(self, values: dict[str, cst.BaseExpression]):
        self.values = values
        self._not_loads: set[int] | None = None

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self._not_loads is None:
            self._not_loads = not_loads(node)
        return super().on_visit(node)

    def leave_Name(self, original, updated):
        if id(original) in self._not_loads:
            return updated
        return self.values.get(original.value, updated)


class _NameRoles(cst.CSTVisitor):
    """One walk of a tree: every Name in order, the ids of those that are not reads
    (keywords, attribute names, parameters, definitions, assignment and loop targets,
    imports) and of augmented-assignment targets (read and written)."""

    def __init__(self) -> None:
        self.names: list[cst.Name] = []
        self.not_loads: set[int] = set()
        self.augmented: set[int] = set()

    def visit_Name(self, node: cst.Name) -> None:
        self.names.append(node)

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self.not_loads.add(id(node.keyword))

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.not_loads.add(id(node.attr))

    def visit_Param(self, node: cst.Param) -> None:
        self.not_loads.add(id(node.name))

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self.not_loads.add(id(node.name))

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.not_loads.add(id(node.name))

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        # `self.x = ...` reads self, `x[i] = ...` reads x and i
        self.not_loads |= (
            {id(n) for n in m.findall(node.target, m.Name())}
            - {id(a.value) for a in m.findall(node.target, m.Attribute())}
            - {
                id(n)
                for s in m.findall(node.target, m.Subscript())
                for n in m.findall(s, m.Name())
            }
        )

    def _named_target(self, node) -> None:
        if isinstance(node.target, cst.Name):
            self.not_loads.add(id(node.target))

    visit_AnnAssign = visit_NamedExpr = _named_target

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        self._named_target(node)
        self.augmented.add(id(node.target))

    def _loop_target(self, node) -> None:
        self.not_loads |= {id(n) for n in m.findall(node.target, m.Name())}

    visit_For = visit_CompFor = _loop_target

    def visit_ImportAlias(self, node: cst.ImportAlias) -> None:
        self.not_loads |= {id(n) for n in m.findall(node, m.Name())}


def _name_roles(root: cst.CSTNode) -> _NameRoles:
    roles = _NameRoles()
    root.visit(roles)
    return roles


def not_loads(root: cst.CSTNode) -> set[int]:
    """ids of the Name nodes under `root` that are not reads: keywords, attribute
    names, parameters, definitions, assignment and loop targets."""
    return _name_roles(root).not_loads


def simplify_function(
    func: cst.FunctionDef,
    known: dict[str, str] | None = None,
    not_none: set[str] | frozenset = frozenset(),
) -> cst.FunctionDef:
    """Fold the facts into one function until nothing changes: substitute, fold, prune
    decided branches, propagate single-assignment literals, drop dead pure stores."""
    params = {p.name.value for p in m.findall(func.params, m.Param())}
    for _ in range(8):
        before = func
        # a known name the function rebinds to something else is not known after that
        # (`if attention_mask is None: attention_mask = torch.ones(...)`)
        rebound = _rebound(func.body)
        func = func.visit(
            Fold({k: v for k, v in (known or {}).items() if k not in rebound}, not_none)
        )
        body = func.body
        # single-assignment literals
        counts: dict[str, int] = {}
        literal: dict[str, cst.BaseExpression] = {}
        for assign in m.findall(body, m.Assign() | m.AugAssign() | m.AnnAssign()):
            for name in stores(cst.SimpleStatementLine([assign])):
                counts[name] = counts.get(name, 0) + 1
            name = (
                _single_name(assign) if not isinstance(assign, cst.AugAssign) else None
            )
            if name and assign.value is not None:
                value = _const(assign.value)
                if value is not _UNKNOWN and isinstance(value, (bool, type(None))):
                    literal[name] = assign.value
        for loop in m.findall(body, m.For() | m.CompFor()):
            for n in m.findall(loop.target, m.Name()):
                counts[n.value] = counts.get(n.value, 0) + 2
        values = {
            k: v for k, v in literal.items() if counts.get(k) == 1 and k not in params
        }
        if values:
            func = func.with_changes(body=func.body.visit(Substitute(values)))
        # dead pure stores (names assigned and never read)
        read = set(loads(func.body))
        dead = {n for n in stores(func.body) if n not in read}
        if dead:
            func = func.with_changes(body=func.body.visit(_DropDead(dead)))
        if func.deep_equals(before):
            break
    return func
