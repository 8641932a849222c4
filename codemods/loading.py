"""Import the transformers module a modeling file defines, to trace and run it.

A file of the installed transformers is imported by its own name. Any other file (a
fork, a Hub repo's remote code, an edited copy) is executed only with
`--trust-remote-code`; it is loaded as a module of a synthetic package under
`transformers.models`, so its imports into the transformers package (`from ...activations
import ACT2FN`) resolve to the installed transformers and its sibling imports
(`from .configuration_x import XConfig`) to its own folder first, then to the installed
model folder of the same name.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

from .errors import CodemodError, FinalError
from .source import ModelSource, transformers_root


def load_module(
    source: ModelSource, trust_remote_code: bool = False
) -> types.ModuleType:
    if source.in_transformers:
        return importlib.import_module(source.import_name)
    if not trust_remote_code:
        raise FinalError(
            f"{source.display} is not part of the installed transformers; running it "
            "(to validate the fusions) needs --trust-remote-code"
        )
    package = f"transformers.models._codemods_{source.sha256[:16]}"
    name = f"{package}.{source.path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    importlib.import_module("transformers.models")
    if package not in sys.modules:
        pkg = types.ModuleType(package)
        installed = transformers_root() / "models" / source.model_type
        pkg.__path__ = [str(source.path.parent)] + (
            [str(installed)] if installed.is_dir() else []
        )
        pkg.__package__ = package
        sys.modules[package] = pkg
    spec = importlib.util.spec_from_file_location(name, source.path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise FinalError(
            f"{source.display}: cannot be imported: {type(exc).__name__}: {exc}"
        ) from None
    return module


def model_classes(
    source: ModelSource, causal_name: str, trust_remote_code: bool = False
):
    """The transformers causal-LM class of `source` (and, through it, its config class)."""
    module = load_module(source, trust_remote_code)
    try:
        return getattr(module, causal_name)
    except AttributeError:
        raise CodemodError(f"{source.display} defines no {causal_name}") from None
