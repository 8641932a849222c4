"""Which pipeline ranks build a module: `if <rank>: <built> else: PPMissingLayer()`."""

from __future__ import annotations

KEEP_EVERY_RANK = "every"


def _rank_guard(lines: list[str], placement: str, tied: bool) -> list[str]:
    if placement == KEEP_EVERY_RANK:
        return lines
    cond = {
        "first": "get_pp_group().is_first_rank",
        "last": "get_pp_group().is_last_rank",
        "first+tied": "get_pp_group().is_first_rank or (config.tie_word_embeddings and get_pp_group().is_last_rank)",
    }[placement]
    comments = []
    while lines and lines[0].lstrip().startswith("#"):
        comments.append(lines[0].strip())
        lines = lines[1:]
    attr = lines[0].split("=", 1)[0].strip()
    return (
        comments
        + [f"if {cond}:"]
        + ["    " + line for line in lines]
        + ["else:", f"    {attr} = PPMissingLayer()"]
    )


def _flatten(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        out += line.split("\n")
    return out
