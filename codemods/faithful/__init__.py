"""The faithful tier: every class emitted from its own source, fused where proven.

What no pattern proves is emitted as the source computes it, with only what vLLM needs
changed (its paged attention for the attention-interface call, its parallel linears by
transformers' own TP plan, its embeddings and head, its interface for positions and
pipeline stages); the classes a pattern proves are emitted fused. See
`../shared/DESIGN.md`, "Faithful by default, fused where proven".
"""

from .generate import FaithfulPlan, generate

__all__ = ["FaithfulPlan", "generate"]
