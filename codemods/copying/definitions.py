"""The source's module-level definitions and imports, and the closure the copied code
needs: every free name of the emitted classes is either a definition of the source
(copied, with the names it needs in turn) or one of its imports (rewritten to an
absolute import, so the generated file imports what the source imports)."""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, ScopeProvider

from fusion_patterns.base import code

from ..errors import CodemodError
from ..source import ModelSource

# decorators the copy keeps: they change what the function computes at inference
KEPT_DECORATORS = {
    "staticmethod",
    "classmethod",
    "property",
    "torch.no_grad",
    "torch.inference_mode",
    "dynamic_rope_update",
}


@dataclass
class Definitions:
    source: ModelSource
    # module-level function / class / assignment nodes by the name they bind
    nodes: dict[str, cst.CSTNode] = field(default_factory=dict)
    # bound name -> absolute import line
    imports: dict[str, str] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


def _absolute(module_parts: list[str], relative: int, source: ModelSource) -> str:
    """`from ...x import` in transformers/models/<type>/ -> `transformers.x`."""
    if relative == 0:
        return ".".join(module_parts)
    if source.in_transformers:
        package = source.import_name.split(".")[:-1]
    else:
        # a file outside transformers is executed as if it were one of its models
        package = ["transformers", "models", source.model_type]
    base = package[: len(package) - (relative - 1)]
    return ".".join(base + module_parts)


def _import_lines(node: cst.BaseSmallStatement, source: ModelSource) -> dict[str, str]:
    out = {}
    if isinstance(node, cst.Import):
        for alias in node.names:
            name = code(alias.name)
            bound = alias.asname.name.value if alias.asname else name.split(".")[0]
            text = f"import {name}" + (f" as {bound}" if alias.asname else "")
            out[bound] = text
    elif isinstance(node, cst.ImportFrom):
        if isinstance(node.names, cst.ImportStar):
            return out
        parts = code(node.module).split(".") if node.module else []
        module = _absolute(parts, len(node.relative), source)
        for alias in node.names:
            name = code(alias.name)
            bound = alias.asname.name.value if alias.asname else name
            text = f"from {module} import {name}" + (
                f" as {bound}" if alias.asname else ""
            )
            out[bound] = text
    return out


def collect(source: ModelSource) -> Definitions:
    defs = Definitions(source)

    def visit(statements):
        for stmt in statements:
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                defs.nodes[stmt.name.value] = stmt
                defs.order.append(stmt.name.value)
            elif isinstance(stmt, cst.SimpleStatementLine):
                for small in stmt.body:
                    if isinstance(small, (cst.Import, cst.ImportFrom)):
                        for bound, line in _import_lines(small, source).items():
                            defs.imports.setdefault(bound, line)
                    elif isinstance(small, (cst.Assign, cst.AnnAssign)):
                        targets = (
                            [t.target for t in small.targets]
                            if isinstance(small, cst.Assign)
                            else [small.target]
                        )
                        for t in targets:
                            if isinstance(t, cst.Name) and t.value not in defs.nodes:
                                defs.nodes[t.value] = stmt
                                defs.order.append(t.value)
            elif isinstance(stmt, (cst.If, cst.Try)):
                # conditional imports (`if is_x_available(): from x import y`)
                visit(stmt.body.body)
                if isinstance(stmt, cst.Try):
                    for handler in stmt.handlers:
                        visit(handler.body.body)
                elif stmt.orelse is not None and isinstance(stmt.orelse, cst.Else):
                    visit(stmt.orelse.body.body)

    visit(source.module.body)
    return defs


def free_names(text: str) -> set[str]:
    """Names `text` reads that nothing in it defines (builtins excluded)."""
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:  # an emitter bug: keep the text to look at
        import tempfile

        with tempfile.NamedTemporaryFile(
            "w", suffix=".py", delete=False, prefix="faithful-"
        ) as f:
            f.write(text)
        raise CodemodError(
            f"internal error: emitted code does not parse ({exc.message.splitlines()[0]} "
            f"at line {exc.raw_line}; the text is in {f.name})"
        ) from None
    wrapper = MetadataWrapper(module)
    scopes = wrapper.resolve(ScopeProvider)
    free = set()
    for scope in set(scopes.values()):
        if scope is None:
            continue
        for access in scope.accesses:
            if not access.referents and isinstance(access.node, cst.Name):
                free.add(access.node.value)
    return free


def strip_decorators(node):
    """Drop decorators that only plug transformers' machinery in (hub kernels, output
    capture, docstrings, experts dispatch): the copy runs the function as written."""
    kept = [d for d in node.decorators if _decorator_name(d) in KEPT_DECORATORS]
    return node.with_changes(decorators=kept)


def _decorator_name(dec: cst.Decorator) -> str:
    target = dec.decorator
    if isinstance(target, cst.Call):
        target = target.func
    return code(target)


def closure(
    defs: Definitions, text: str, emitted: set[str]
) -> tuple[list[str], list[str]]:
    """(definitions to copy, in source order; import lines) for the free names of
    `text`. `emitted`: names the generated file defines itself."""
    wanted: list[str] = []
    imports: set[str] = set()
    pending = [text]
    while pending:
        for name in free_names(pending.pop()):
            if name in emitted or name in wanted:
                continue
            if name in defs.nodes:
                wanted.append(name)
                pending.append(code(_copyable(defs.nodes[name])))
            elif name in defs.imports:
                imports.add(defs.imports[name])
            else:
                raise CodemodError(
                    f"cannot generate: the copied code reads `{name}`, which {defs.source.display} neither defines nor imports"
                )
    ordered = [n for n in defs.order if n in wanted]
    return list(dict.fromkeys(ordered)), sorted(imports)


def _copyable(node):
    if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
        return strip_decorators(node)
    return node


def copied_text(defs: Definitions, names: list[str]) -> list[str]:
    """Source text of the definitions to copy, decorators stripped, once each."""
    seen, out = set(), []
    for name in names:
        node = _copyable(defs.nodes[name])
        if id(defs.nodes[name]) in seen:
            continue
        seen.add(id(defs.nodes[name]))
        out.append(code(node).strip("\n"))
    return out


def is_relative_sibling(line: str, source: ModelSource) -> bool:
    return (
        not source.in_transformers and ".models." in line and source.model_type in line
    )


def uses(node: cst.CSTNode, name: str) -> bool:
    return bool(m.findall(node, m.Name(name)))
