"""Modules the base model ties to another (Zamba 2's shared attention blocks: its
`_tied_weights_keys = {"layers.8.shared_transformer": "layers.2.shared_transformer"}`,
filled as it builds its layers). `save_pretrained` writes the tied-to module once. The
generated model builds every copy, then each copy on this pipeline stage takes the
weight-holding modules of the first one here (`SHARE_TIED`): one set of weights, loaded
once, while each copy keeps its own vLLM attention and KV cache (and any other layer keyed
by its path), as vLLM's own zamba2.py does. The loader hands the checkpoint's tensors to
every copy's names (`TIED_COPIES`), so the first copy on a later stage gets them too."""

from __future__ import annotations

import libcst.matchers as m

from ..roles import Roles

TIED = m.Attribute(value=m.Name("self"), attr=m.Name("_tied_weights_keys"))

TIED_COPIES = """
    def _tied_copies(self, weights: Iterable[tuple[str, torch.Tensor]]):
        # a module the source ties others to is saved once: its tensors go to each copy
        tied = getattr(self.{base}, "_tied_weights_keys", None) or {{}}
        for name, tensor in weights:
            yield name, tensor
            for copy, target in tied.items():
                head = f"{base}.{{target}}."
                if name.startswith(head):
                    yield f"{base}.{{copy}}." + name[len(head) :], tensor
"""


SHARE_TIED = """
def share_tied_weights(model: nn.Module) -> None:
    # the copies of a module the source ties hold one set of weights: each copy on this
    # stage takes the first one's weight-holding modules, keeping its own attention
    groups: dict[str, list[str]] = {}
    for copy, target in model._tied_weights_keys.items():
        groups.setdefault(target, [target]).append(copy)
    for names in groups.values():
        here = [
            model.get_submodule(n)
            for n in names
            if not _on_another_stage(model, n)
        ]
        for copy in here[1:]:
            _take_weights(here[0], copy)


def _on_another_stage(model: nn.Module, name: str) -> bool:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        if isinstance(model.get_submodule(".".join(parts[:i])), PPMissingLayer):
            return True
    return False


def _keyed(module: nn.Module) -> bool:
    # a layer vLLM keys by its path (attention, a Mamba mixer: their caches), or one
    # holding such a layer
    return any(isinstance(m, AttentionLayerBase) for m in module.modules())


def _take_weights(holder: nn.Module, copy: nn.Module) -> None:
    for name, child in list(copy.named_children()):
        if _keyed(child):
            _take_weights(getattr(holder, name), child)
        else:
            setattr(copy, name, getattr(holder, name))
    for name in list(copy._parameters):
        copy._parameters[name] = holder._parameters[name]
"""


def ties_modules(roles: Roles) -> bool:
    """The base model fills `self._tied_weights_keys` (in `__init__` or the method
    building its layers)."""
    return bool(m.findall(roles.base.node, TIED))


def init_lines(roles: Roles) -> list[str]:
    """After the layers are built: the tied copies share their weights."""
    return ["share_tied_weights(self)"] if ties_modules(roles) else []


def loader_methods(roles: Roles) -> str:
    return TIED_COPIES.format(base=".".join(roles.chain))
