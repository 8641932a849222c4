"""Mamba-2 mixers -> vLLM's `MambaMixer2` (its conv and SSM state caches).

Issue 38, first slice: the match (`match.py`), the proof (`proof.py`), and what the
file will hold (`emit.py`: the `MambaMixer2(...)` construction and the causal LM's state
methods from the same expressions). The pattern is not in the registry yet, so no
generated file changes. Next: the call site on vLLM's [tokens, hidden], the hybrid frame
in the assembly (`IsHybrid`, `HasInnerState`), the loader's names, then the models.
"""

from .match import NAME, VLLM_CLASS, WHAT, Mamba2Spec, match
from .proof import prove

__all__ = ["NAME", "VLLM_CLASS", "WHAT", "Mamba2Spec", "match", "prove"]
