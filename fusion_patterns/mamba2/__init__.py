"""Mamba-2 mixers -> vLLM's `MambaMixer2` (its conv and SSM state caches).

Issue 38, first slice: the match (`match.py`) and the proof (`proof.py`); the pattern
is not in the registry yet, so no generated file changes. Next: the emitted
construction and call, the hybrid frame (`IsHybrid`, the state shapes from the same
config expressions), the loader's names, then the models.
"""

from .match import NAME, VLLM_CLASS, WHAT, Mamba2Spec, match
from .proof import prove

__all__ = ["NAME", "VLLM_CLASS", "WHAT", "Mamba2Spec", "match", "prove"]
