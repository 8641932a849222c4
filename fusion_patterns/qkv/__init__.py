"""q/k/v projections of one input -> `QKVParallelLinear`.

Two patterns share the match (`match.py`) and the proofs (`proof.py`): `NativeAttention`
(`native.py`) takes the whole attention class into vLLM's own layout where every part of
it is proven; `QKVMerge` (`merge.py`) merges only the projections of a copied attention.
"""

from .match import NAME, VLLM_CLASS, HeadNorm, QKVSpec, match, merged_name, records
from .merge import QKVMerge
from .native import NativeAttention
from .proof import reorder_interleaved

__all__ = [
    "HeadNorm",
    "NAME",
    "NativeAttention",
    "QKVMerge",
    "QKVSpec",
    "VLLM_CLASS",
    "match",
    "merged_name",
    "records",
    "reorder_interleaved",
]
