"""The paths a proof on the tiny instance does not run: a class whose forward branches
on the config (`if self.qk_layernorm:`, `if self.q_lora_rank is None:`) is rebuilt on
a config taking each other combination of those branches, so its tensor-parallel proof
covers every path a checkpoint can take, not only the tiny config's.

A branch is flipped by setting one config field it reads (a flag negated, a count set
to None or a small integer, None set to a small integer); the first setting that takes
the combination, builds the class and runs it is the one proven, chosen before any
proof runs.
"""

from __future__ import annotations

import copy
import itertools
import re
from dataclasses import dataclass

import libcst as cst
import torch

from fusion_patterns.base import ClassInfo, PatternRefused, code
from fusion_patterns.state_layers import rebuilt

from .config_branches import DecidedBranch, decided_branches

# 2**4 - 1 rebuilt classes at most: beyond that the branches are not proven
MAX_BRANCHES = 4
_SETTINGS_PER_COMBINATION = 16
UNREAD_BRANCHES = (
    "its forward branches on the config where the tiny model cannot say which way"
)


@dataclass
class OtherBranch:
    flipped: frozenset[int]  # the decided branches it takes the other way
    # the config the class was rebuilt on ("config.qk_layernorm=True"), or why none
    label: str
    instance: object | None  # None: nothing to prove on
    call: tuple | None  # (args, kwargs, output) as the probe records a call

    def failed(self, why: str) -> str:
        """A proof's failure `why` on this config, said with the config."""
        return f"with {self.label} {why.removeprefix('sharded ').removeprefix(', ')}"


@dataclass
class Branches:
    decided: list[DecidedBranch]
    others: list[OtherBranch]

    def failures(self, plan: dict[str, str], prove) -> dict[frozenset[int], str]:
        """{the branches flipped: why} for each other way `prove(other)` fails on,
        builds nothing to run, or builds none of the linears `plan` shards (a proof
        of none is no proof: the class's head counts are divided all the same)."""
        from fusion_patterns import sharding

        sharded = [
            a for a, s in plan.items() if sharding.is_column(s) or s == "rowwise"
        ]
        out = {}
        for other in self.others:
            if other.instance is None:
                out[other.flipped] = other.label
            elif sharded and all(
                getattr(other.instance, a, None) is None for a in sharded
            ):
                out[other.flipped] = other.failed(
                    "it builds none of the linears the plan shards"
                )
            elif (why := prove(other)) is not None:
                out[other.flipped] = other.failed(why)
        return out

    def pinned(self, failed: set[frozenset[int]]) -> str:
        """The branches, as the tiny instance takes them, a sharded module must take
        where the combinations in `failed` fail: those whose flip alone fails, unless
        a combination taking each of them fails too (then all of them)."""
        alone = {i for s in failed if len(s) == 1 for i in s}
        if any(not s & alone for s in failed):
            alone = set(range(len(self.decided)))
        pins = [self.decided[i].text() for i in sorted(alone)]
        if len(pins) == 1:  # one test needs no parentheses of its own
            return code(cst.parse_expression(pins[0]).with_changes(lpar=[], rpar=[]))
        return " and ".join(pins)

    def any_of(self, ways: list[frozenset[int]]) -> str:
        """The config test taking one of `ways` (each a set of branches flipped from
        the tiny config's), simplified: a branch both ways of which are among them is
        not tested (`(a and b) or (a and not b)` is `a`)."""
        terms = {
            frozenset((i, b.taken != (i in w)) for i, b in enumerate(self.decided))
            for w in ways
        }
        merged = True
        while merged:
            merged = False
            for term in sorted(terms, key=sorted):
                for i, value in term:
                    other = (term - {(i, value)}) | {(i, not value)}
                    if other in terms:
                        terms -= {term, other}
                        terms.add(term - {(i, value)})
                        merged = True
                        break
                if merged:
                    break
        texts = [
            " and ".join(self.decided[i].text(v) for i, v in sorted(t))
            for t in sorted(terms, key=sorted)
        ]
        if len(texts) == 1:
            return code(cst.parse_expression(texts[0]).with_changes(lpar=[], rpar=[]))
        return " or ".join(f"({t})" if " and " in t else t for t in texts)


def other_branches(
    info: ClassInfo, instance, call, config, settled: str | None = None
) -> Branches | None:
    """`instance`'s class rebuilt on a config for each other combination of its
    config-decided branches (but `settled`, a test the module checks when built), with
    its output on `call`'s inputs; None where a branch cannot be read on the
    instance."""
    decided = decided_branches(info, instance)
    if decided is None:
        return None
    decided = [b for b in decided if settled is None or b.config.strip("()") != settled]
    config = getattr(instance, "config", None) or config
    settings = [_flips(b, config) for b in decided]
    # a branch no config the class accepts takes the other way has nothing to prove
    decided = [b for b, s in zip(decided, settings) if s is not None]
    settings = [s for s in settings if s is not None]
    out = Branches(decided, [])
    if decided and (call is None or len(decided) > MAX_BRANCHES):
        # not proven: every branch pinned
        every = frozenset(range(len(decided)))
        why = "the tiny model never calls it" if call is None else "too many to run"
        label = f"its {len(decided)} config branches are not run ({why})"
        out.others.append(OtherBranch(every, label, None, None))
        return out
    for flipped in _combinations(len(decided)):
        out.others.append(
            _rebuilt_taking(instance, call, config, decided, settings, flipped)
        )
    return out


def _combinations(count: int) -> list[frozenset[int]]:
    """Every non-empty set of branch indices to flip, smallest first."""
    return [
        frozenset(c)
        for size in range(1, count + 1)
        for c in itertools.combinations(range(count), size)
    ]


def _fields(branch: DecidedBranch) -> list[str]:
    """The config paths `branch` reads (`attn_config.clip_qkv`)."""
    return list(dict.fromkeys(re.findall(r"\bconfig((?:\.\w+)+)", branch.config)))


def _candidates(value) -> list:
    if isinstance(value, bool):
        return [not value]
    if value is None:
        return [True, 1, 2, 4, 8, 16]
    if isinstance(value, int):
        return [None, 0, 1, 2, value + 1, 2 * value]
    if isinstance(value, float):
        return [None, 0.0, 1.0, 2 * value]
    if isinstance(value, str):
        return [None]
    return []


def _get(config, path: str):
    for name in path.strip(".").split("."):
        config = getattr(config, name, None)
    return config


def _set(config, path: str, value, validated: bool = True):
    names = path.strip(".").split(".")
    owner = config
    for name in names[:-1]:
        owner = getattr(owner, name)
    if validated:
        setattr(owner, names[-1], value)
    else:  # past the config class's own checks
        object.__setattr__(owner, names[-1], value)


def _takes(branch: DecidedBranch, config) -> bool | None:
    try:
        return bool(eval(branch.config, {"config": config}))  # noqa: S307 - source text
    except Exception:  # noqa: BLE001 - a value the test cannot take
        return None


def _flips(branch: DecidedBranch, config) -> list[tuple[str, object]] | None:
    """Single field settings under which the config takes `branch` the other way;
    None where each that would is one the config class rejects (GPT-J's `rotary_dim`
    is an int: `rotary_dim is not None` is always taken)."""
    found, rejected = [], False
    for path in _fields(branch):
        for value in _candidates(_get(config, path)):
            other = copy.deepcopy(config)
            try:
                _set(other, path, value)
            except Exception:  # noqa: BLE001 - a value the config class rejects
                try:
                    _set(other, path, value, validated=False)
                except Exception:  # noqa: BLE001 - a derived field
                    continue
                rejected = rejected or _takes(branch, other) is (not branch.taken)
                continue
            if _takes(branch, other) is (not branch.taken):
                found.append((path, value))
    return None if rejected and not found else found


def _rebuilt_taking(instance, call, config, decided, settings, flipped):
    """The class rebuilt on the first setting taking exactly the branches in
    `flipped` the other way that builds and runs (no instance where none does)."""
    choices = [settings[i] if i in flipped else [None] for i in range(len(decided))]
    for combo in itertools.islice(
        itertools.product(*choices), _SETTINGS_PER_COMBINATION
    ):
        other = copy.deepcopy(config)
        for setting in combo:
            if setting is not None:
                _set(other, *setting)
        wanted = [b.taken != (i in flipped) for i, b in enumerate(decided)]
        if [_takes(b, other) for b in decided] != wanted:
            continue
        built = _built_and_run(instance, other, call)
        if built is not None:
            label = ", ".join(f"config{p}={v!r}" for p, v in filter(None, combo))
            return OtherBranch(flipped, label, *built)
    ways = " and ".join(
        b.text(b.taken != (i in flipped)) for i, b in enumerate(decided)
    )
    return OtherBranch(
        flipped, f"no config taking `{ways}` builds it to run", None, None
    )


def _built_and_run(instance, config, call):
    """(the class built on `config` as a linear-holding module, its call with its own
    output) where it builds and its output on `call`'s inputs is finite, else None."""
    from fusion_patterns import sharding

    args, kwargs, _ = call
    try:
        module = sharding.as_linears(rebuilt(instance, config))
        module.eval()
        with torch.no_grad():
            output = module(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    except (PatternRefused, Exception):  # noqa: BLE001 - a config this class rejects
        return None
    first = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(first, torch.Tensor) or not torch.isfinite(first).all():
        return None
    return module, (args, kwargs, output)
