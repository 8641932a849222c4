"""Modules the base model ties to another (Zamba 2's shared attention blocks: its
`_tied_weights_keys = {"layers.8.shared_transformer": "layers.2.shared_transformer"}`,
filled as it builds its layers). `save_pretrained` writes the tied-to module once; the
generated model builds every copy (each with its own vLLM attention and KV cache, as
vLLM's own zamba2.py does) and loads the checkpoint's tensors into each of them."""

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


def ties_modules(roles: Roles) -> bool:
    """The base model fills `self._tied_weights_keys` (in `__init__` or the method
    building its layers)."""
    return bool(m.findall(roles.base.node, TIED))


def loader_methods(roles: Roles) -> str:
    return TIED_COPIES.format(base=".".join(roles.chain))
