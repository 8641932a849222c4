"""Tensor parallelism for copied classes: a plan of column/row styles, proven per class.

A class's linears are sharded as the config class's `base_model_tp_plan` says
(colwise / rowwise; the gathered variants behave like replicated ones), but only if
that class, alone, computes the same function sharded: the proof splits its column-
parallel weights by output and its row-parallel ones by input over two simulated
ranks, divides its head counts, runs each rank's copy on the inputs the class received
in the source's own tiny model, and sums what the ranks return (the all-reduce after a
row-parallel layer). Reshapes that count heads or features as a whole, or a norm over
a whole projection, fail it; the class is then replicated, which is always correct.
"""

from __future__ import annotations

import copy

RANKS = 2
TOLERANCE = 1e-5
SHARDED = {"colwise", "rowwise"}


class _AllReduce:
    """The all-reduce after a row-parallel layer, between simulated ranks run as threads."""

    def __init__(self):
        import threading

        self.barrier = threading.Barrier(RANKS, timeout=120)
        self.slots: list = [None] * RANKS

    def __call__(self, rank: int, partial):
        self.slots[rank] = partial
        self.barrier.wait()
        total = sum(self.slots[1:], self.slots[0])
        self.barrier.wait()
        return total


def _row_parallel(linear, rank: int, reduce: _AllReduce):
    import torch
    from torch import nn

    weight = linear.weight.data.chunk(RANKS, 1)[rank].clone()
    bias = linear.bias.data.clone() if linear.bias is not None and rank == 0 else None

    class RowParallel(nn.Module):
        def forward(self, x):
            return reduce(rank, torch.nn.functional.linear(x, weight, bias))

    return RowParallel()


def _shard(module, styles, head_attrs, sinks, rank: int, reduce: _AllReduce):
    shard = copy.deepcopy(module)
    for attr, style in styles.items():
        linear = getattr(shard, attr)
        w = linear.weight.data
        if style == "colwise":
            if w.shape[0] % RANKS:
                raise ValueError(
                    f"self.{attr} has {w.shape[0]} outputs, not divisible by {RANKS}"
                )
            linear.weight.data = w.chunk(RANKS, 0)[rank].clone()
            if linear.bias is not None:
                linear.bias.data = linear.bias.data.chunk(RANKS, 0)[rank].clone()
            linear.out_features = linear.weight.shape[0]
        elif style == "rowwise":
            if w.shape[1] % RANKS:
                raise ValueError(
                    f"self.{attr} has {w.shape[1]} inputs, not divisible by {RANKS}"
                )
            setattr(shard, attr, _row_parallel(linear, rank, reduce))
    for attr in head_attrs:
        value = getattr(shard, attr)
        if value % RANKS:
            raise ValueError(f"self.{attr} = {value} heads, not divisible by {RANKS}")
        setattr(shard, attr, value // RANKS)
    if sinks:
        param = getattr(shard, sinks.removeprefix("self."), None)
        if param is not None:
            param.data = param.data.chunk(RANKS, 0)[rank].clone()
    return shard


def _first(out):
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def prove(
    module, styles: dict[str, str], head_attrs: list[str], call, sinks=None
) -> str | None:
    """None when `module` computes the same sharded over two ranks, else the reason."""
    import threading

    import torch

    sharded = {a: s for a, s in styles.items() if s in SHARDED}
    if not sharded:
        return None
    if call is None:
        return "the tiny model never calls it"
    args, kwargs, want = call
    want = _first(want)
    reduce = _AllReduce()
    outs: list = [None] * RANKS
    errors: list = []

    def rank_run(rank: int):
        try:
            with torch.no_grad():
                shard = _shard(module, sharded, head_attrs, sinks, rank, reduce)
                outs[rank] = _first(
                    shard(*copy.deepcopy(args), **copy.deepcopy(kwargs))
                )
        except Exception as exc:  # noqa: BLE001 - a reshape that counts the whole
            errors.append(exc)
            reduce.barrier.abort()

    threads = [threading.Thread(target=rank_run, args=(r,)) for r in range(RANKS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        exc = (real or errors)[0]
        text = str(exc).splitlines()[0] if str(exc) else ""
        return (
            f"sharded over {RANKS} ranks it fails ({type(exc).__name__}: {text[:120]})"
        )
    for got in outs:
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            return "sharded, a rank returns another shape (its output is not reduced in the class)"
        err = (got.float() - want.float()).abs().max().item()
        ref = want.float().abs().max().item() or 1.0
        if err / ref > TOLERANCE:
            return f"sharded over {RANKS} ranks it computes something else (relative error {err / ref:.1e})"
    return None

