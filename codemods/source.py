"""Stage 1: locate and parse a transformers modeling file, and read its classes."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

import libcst as cst

from .errors import CodemodError

if TYPE_CHECKING:
    from fusion_patterns.base import ClassInfo

MODELING_NAME = re.compile(r"modeling_(\w+)\.py")


def transformers_root() -> Path:
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        raise CodemodError("transformers is not installed")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


@dataclass(frozen=True)
class ModelSource:
    path: Path
    # Path inside the installed transformers ("transformers/models/qwen3/modeling_qwen3.py"),
    # or the path as given for a file from elsewhere.
    display: str
    text: str
    sha256: str
    module: cst.Module
    model_type: str
    in_transformers: bool
    # every class the file defines, by name (the patterns read these)
    classes: dict[str, ClassInfo]

    @property
    def import_name(self) -> str | None:
        """Dotted module name inside transformers, for importing the reference model."""
        if not self.in_transformers:
            return None
        return self.display[: -len(".py")].replace("/", ".")


def resolve(name: str) -> Path:
    """A path as given, or a bare `modeling_x.py` looked up in the installed transformers."""
    path = Path(name)
    if path.exists():
        return path
    if path.name == name and MODELING_NAME.fullmatch(name):
        found = sorted(transformers_root().glob(f"models/*/{name}"))
        if found:
            return found[0]
        raise CodemodError(
            f"{name}: no such file, and the installed transformers has no {name}"
        )
    raise CodemodError(f"{name}: no such file")


def load(name: str) -> ModelSource:
    path = resolve(name)
    if path.is_dir():
        raise CodemodError(f"{name}: is a directory, not a modeling file")
    if path.suffix != ".py":
        raise CodemodError(f"{name}: not a Python file (expected modeling_<type>.py)")
    try:
        raw = path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CodemodError(f"{name}: cannot read: {exc}") from None
    try:
        ast.parse(text, filename=str(path))
    except SyntaxError as exc:
        raise CodemodError(
            f"{path}:{exc.lineno}:{exc.offset}: syntax error: {exc.msg}"
        ) from None
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        raise CodemodError(
            f"{path}:{exc.raw_line}:{exc.raw_column}: syntax error: {exc.message}"
        ) from None
    resolved = path.resolve()
    root = transformers_root()
    in_transformers = resolved.is_relative_to(root)
    display = (
        f"transformers/{resolved.relative_to(root).as_posix()}"
        if in_transformers
        else str(path)
    )
    match = MODELING_NAME.fullmatch(path.name)
    return ModelSource(
        path=resolved,
        display=display,
        text=text,
        sha256=hashlib.sha256(raw).hexdigest(),
        module=module,
        model_type=match.group(1) if match else path.stem,
        in_transformers=in_transformers,
        classes=class_infos(module),
    )


def class_infos(module: cst.Module) -> dict[str, ClassInfo]:
    """The classes a module defines: their `__init__`, `forward` and attributes."""
    # imported here: `check` reads sources without libcst's matchers (0.5 s)
    import libcst.matchers as m

    from fusion_patterns.base import ClassInfo, dotted_name

    out = {}
    for node in module.body:
        if not isinstance(node, cst.ClassDef):
            continue
        methods = {
            s.name.value: s for s in node.body.body if isinstance(s, cst.FunctionDef)
        }
        init = methods.get("__init__")
        attrs: dict[str, cst.BaseExpression] = {}
        choices: dict[str, list[cst.BaseExpression]] = {}
        if init is not None:
            for assign in m.findall(
                init,
                m.Assign(
                    targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))]
                ),
            ):
                attrs.setdefault(assign.targets[0].target.attr.value, assign.value)
                choices.setdefault(assign.targets[0].target.attr.value, []).append(
                    assign.value
                )
        out[node.name.value] = ClassInfo(
            node=node,
            name=node.name.value,
            bases=tuple(filter(None, (dotted_name(b.value) for b in node.bases))),
            init=init,
            forward=methods.get("forward"),
            attrs=attrs,
            choices=choices,
        )
    return out
