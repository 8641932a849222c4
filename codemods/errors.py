"""The one error type the command lines turn into a one-line message and exit 2."""


class CodemodError(Exception):
    """Input the toolkit cannot turn into a correct model; the message is one line."""

    exit_code = 2
    # input no layout can serve (not a modeling file, remote code not trusted): the
    # faithful layout is not tried
    final = False


class FinalError(CodemodError):
    final = True
