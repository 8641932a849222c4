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
