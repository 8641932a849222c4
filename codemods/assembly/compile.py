"""Whether vLLM may compile the base model: `@support_torch_compile` captures one full
graph, which an op whose output shape depends on the data cannot be part of (transformers'
loop over the experts a batch hits: `.nonzero()`, one-argument `torch.where`). Found in the
emitted code, so a part a pattern fused away does not count."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

# methods and functions whose result's shape (or a Python value) depends on the data
DATA_DEPENDENT = {
    "nonzero",
    "tolist",
    "item",
    "unique",
    "unique_consecutive",
    "argwhere",
}


def data_dependent(code: str) -> list[tuple[str, str]]:
    """(enclosing class or function, construct) for each data-dependent call in `code`."""
    found: list[tuple[str, str]] = []

    class Finder(cst.CSTVisitor):
        def __init__(self) -> None:
            self.owners: list[str] = []

        def visit_ClassDef(self, node: cst.ClassDef) -> None:
            self.owners.append(node.name.value)

        def leave_ClassDef(self, node: cst.ClassDef) -> None:
            self.owners.pop()

        def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
            if not self.owners:
                self.owners.append(node.name.value)

        def leave_FunctionDef(self, node: cst.FunctionDef) -> None:
            if self.owners == [node.name.value]:
                self.owners.pop()

        def visit_Call(self, node: cst.Call) -> None:
            owner = self.owners[0] if self.owners else "<module>"
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value in DATA_DEPENDENT:
                found.append((owner, f".{func.attr.value}()"))
            elif (
                m.matches(
                    func, m.Attribute(value=m.Name("torch"), attr=m.Name("where"))
                )
                and len(node.args) == 1
            ):
                found.append((owner, "torch.where(<condition>)"))

    cst.parse_module(code).visit(Finder())
    return found


def data_loops(code: str) -> list[tuple[str, str]]:
    """(enclosing class, iterable) for each Python `for` over a data-dependent value
    (`for expert_idx in expert_hit:` with `expert_hit = ....nonzero()`): one step per
    expert a batch hits, each its own small matmul."""
    found: list[tuple[str, str]] = []
    for cls in cst.parse_module(code).body:
        if not isinstance(cls, cst.ClassDef):
            continue
        for func in m.findall(cls, m.FunctionDef()):
            dependent = {
                a.targets[0].target.value
                for a in m.findall(func, m.Assign(targets=[m.AssignTarget(m.Name())]))
                if data_dependent(cst.Module([]).code_for_node(a.value))
            }
            for loop in m.findall(func, m.For()):
                text = cst.Module([]).code_for_node(loop.iter)
                if (
                    isinstance(loop.iter, cst.Name) and loop.iter.value in dependent
                ) or data_dependent(text):
                    found.append((cls.name.value, text))
    return found
