"""The one error type the command lines turn into a one-line message and exit 2."""


class CodemodError(Exception):
    """Input the toolkit cannot turn into a correct model; the message is one line."""

    exit_code = 2
    # input no layout can serve (not a modeling file, remote code not trusted): the
    # faithful layout is not tried
    final = False


class FinalError(CodemodError):
    final = True


class BeyondAttention(CodemodError):
    """An attention vLLM's `Attention` cannot take as the source computes it (a mask or
    a sparse index that depends on the data); `what` says which. Where the model's
    architecture is known, it is said as `vllm_native.unmapped` says a part no pattern
    maps: out of scope where vLLM has no class for it either."""

    def __init__(self, what: str):
        super().__init__(f"cannot generate: {what}")
        self.what = what


def error_line(error: str) -> str:
    """An error's most telling line: a pydantic validator's own message (vLLM's config
    checks) rather than its "1 validation error for ModelConfig" header."""
    lines = [line.strip() for line in error.splitlines() if line.strip()] or [""]
    for line in lines[1:]:
        if line.startswith("Value error, "):
            return line[len("Value error, ") :].split(" [type=")[0]
    return lines[0]
