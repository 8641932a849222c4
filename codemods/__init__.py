"""libcst codemods that turn a transformers modeling file into a native vLLM model file.

The pipeline, one module per stage:
source (locate, parse) -> structure (match the fusion patterns) -> plan (fusion records
and the tables derived from them) -> emit (the vLLM file) -> render (header, black) ->
apply / verify (the command lines).
"""

__version__ = "0.1.0"
