"""Fusion patterns: one module (or package) per fusion, each a libcst matcher over
transformers modeling sources, its proof on the real module, its rewrite, and what it
contributes to the generated file's tables. `registry.PATTERNS` lists them in order."""
