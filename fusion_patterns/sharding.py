"""Tensor parallelism for copied classes: a plan of column/row styles, proven per class.

A class's linears are sharded as the config class's `base_model_tp_plan` says
(colwise / rowwise; the gathered variants behave like replicated ones) or, for a class
the plan has no entry for, as its dataflow says (`derive`: Megatron's pairs, the
linears feeding another linear column-parallel, that one row-parallel), but only if
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
# a column-parallel linear whose output the source splits into equal parts (GPT-2's
# `c_attn`, q|k|v): each part sharded on its own, as vLLM's merged linear holds them
PACKED = "colwise_packed_"


# a column-parallel linear holding [q; k; v] whole, with fewer kv heads than the query's
# (GPTBigCode's multi-query `c_attn`): vLLM's QKVParallelLinear, which splits the query
# heads over the ranks and replicates kv heads on ranks beyond their count
QKV = "colwise_qkv"


def is_column(style: str) -> bool:
    return style in ("colwise", QKV) or style.startswith(PACKED)


def qkv_layout(module, attr: str, head_attrs, kv_attrs) -> tuple[int, int, int] | None:
    """(query heads, kv heads, head size) where `attr`'s outputs are that many query
    heads then twice that many kv heads of one size, fewer kv heads than query heads
    and either a multiple of the ranks or a divisor of them; else None."""
    q = [getattr(module, a) for a in head_attrs if a not in kv_attrs]
    kv = [getattr(module, a) for a in kv_attrs]
    linear = getattr(module, attr, None)
    if not q or not kv or linear is None or not 0 < kv[0] < q[0]:
        return None
    heads, kv_heads = q[0], kv[0]
    if kv_heads % RANKS and RANKS % kv_heads:
        return None
    size, rest = divmod(linear.out_features, heads + 2 * kv_heads)
    return (heads, kv_heads, size) if size and not rest else None


def group_attrs(module, layout, head_attrs) -> list[str]:
    """The module's integer attributes counting query heads per kv head (transformers'
    `num_key_value_groups`, read by its eager attention): named so, as a value alone
    can be a head size too."""
    heads, kv_heads, _ = layout
    return [
        a
        for a, v in vars(module).items()
        if type(v) is int
        and v == heads // kv_heads
        and "group" in a
        and a not in head_attrs
    ]


def kv_share(kv_heads: int) -> int:
    """One rank's kv heads as QKVParallelLinear holds them: a share, or one replica."""
    return max(1, kv_heads // RANKS)


def candidates(module, plan: dict[str, str], head_attrs=(), kv_attrs=()):
    """`plan`, then each column-parallel linear of it taken as 3 or 2 equal packed parts,
    or as [q; k; v] with fewer kv heads (the proof tells which the source computes)."""
    yield plan
    for attr, style in plan.items():
        if style != "colwise" or getattr(module, attr, None) is None:
            continue
        out = getattr(module, attr).out_features
        for parts in (3, 2):
            if out % (parts * RANKS) == 0:
                yield {**plan, attr: f"{PACKED}{parts}"}
        if qkv_layout(module, attr, head_attrs, kv_attrs):
            yield {**plan, attr: QKV}


def as_linears(module):
    """`module`, or a copy of it whose transformers `Conv1D` children (a linear storing
    its weight [in, out]) are `nn.Linear`s computing the same: what the generated file
    builds in their place, and what the plan and its proof look at."""
    from torch import nn

    convs = [
        n
        for n, c in module.named_children()
        if type(c).__name__ == "Conv1D" and hasattr(c, "nf")
    ]
    if not convs:
        return module
    module = copy.deepcopy(module)
    for n in convs:
        conv = getattr(module, n)
        nx, nf = conv.weight.shape
        linear = nn.Linear(nx, nf, bias=conv.bias is not None)
        linear.weight.data = conv.weight.data.t().contiguous()
        if conv.bias is not None:
            linear.bias.data = conv.bias.data.clone()
        setattr(module, n, linear)
    return module


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


def _qkv_rows(t, layout, rank: int):
    """This rank's rows of a [q; k; v] tensor: its query heads, its kv heads' share or
    the one kv head it replicates (QKVParallelLinear's split)."""
    import torch

    heads, kv_heads, size = layout
    q, k, v = t.split([heads * size, kv_heads * size, kv_heads * size])
    if kv_heads % RANKS == 0:
        kv_rows = slice(
            rank * kv_heads // RANKS * size, (rank + 1) * kv_heads // RANKS * size
        )
    else:  # fewer kv heads than ranks: each rank holds the head of its group
        head = rank * kv_heads // RANKS
        kv_rows = slice(head * size, (head + 1) * size)
    return torch.cat([q.chunk(RANKS, 0)[rank], k[kv_rows], v[kv_rows]])


def _shard(
    module, styles, head_attrs, sinks, rank: int, reduce: _AllReduce, kv_attrs=()
):
    import torch

    shard = copy.deepcopy(module)
    layouts = {
        a: qkv_layout(module, a, head_attrs, kv_attrs)
        for a, s in styles.items()
        if s == QKV
    }
    for attr, style in styles.items():
        linear = getattr(shard, attr, None)
        if linear is None:  # a layer that does not build it
            continue
        w = linear.weight.data
        if style == QKV:
            layout = layouts[attr]
            if layout is None:
                raise ValueError(f"self.{attr} does not hold [q; k; v] heads")
            linear.weight.data = _qkv_rows(w, layout, rank).clone()
            if linear.bias is not None:
                linear.bias.data = _qkv_rows(linear.bias.data, layout, rank).clone()
            linear.out_features = linear.weight.shape[0]
        elif is_column(style):
            # a packed projection's parts each split over the ranks (one part: plain)
            parts = int(style.removeprefix(PACKED)) if style != "colwise" else 1
            if w.shape[0] % (parts * RANKS):
                of = f"{parts} parts " if parts > 1 else ""
                raise ValueError(
                    f"self.{attr} has {w.shape[0]} outputs, not {of}divisible by {RANKS}"
                )

            def mine(t):
                return torch.cat([p.chunk(RANKS, 0)[rank] for p in t.chunk(parts, 0)])

            linear.weight.data = mine(w).clone()
            if linear.bias is not None:
                linear.bias.data = mine(linear.bias.data).clone()
            linear.out_features = linear.weight.shape[0]
        elif style == "rowwise":
            if w.shape[1] % RANKS:
                raise ValueError(
                    f"self.{attr} has {w.shape[1]} inputs, not divisible by {RANKS}"
                )
            setattr(shard, attr, _row_parallel(linear, rank, reduce))
    for layout in filter(None, layouts.values()):
        # query heads per kv head (`num_key_value_groups`): fewer, where kv heads
        # are replicated rather than split
        for attr in group_attrs(module, layout, head_attrs):
            heads, kv_heads, _ = layout
            setattr(shard, attr, heads // RANKS // kv_share(kv_heads))
    for attr in head_attrs:
        value = getattr(shard, attr)
        if layouts and attr in kv_attrs:  # as QKVParallelLinear holds them
            setattr(shard, attr, kv_share(value))
            continue
        if value % RANKS:
            raise ValueError(f"self.{attr} = {value} heads, not divisible by {RANKS}")
        setattr(shard, attr, value // RANKS)
    if sinks:
        param = getattr(shard, sinks.removeprefix("self."), None)
        if param is not None:
            param.data = param.data.chunk(RANKS, 0)[rank].clone()
    return shard


def derive(module, call, kept: set[str] = frozenset()) -> dict[str, str] | str:
    """Column/row styles for `module`'s own linears from its dataflow, or why there are
    none. The dataflow is measured, not read: the class runs on the inputs the tiny
    model gave it, once as it is and once with each linear's output perturbed, and a
    linear "feeds" another when perturbing it changes the other's input. A linear fed
    by others and feeding none, whose output reaches the class's, is row-parallel; the
    linears feeding it directly (not through another linear) are column-parallel: q/k/v
    before attention and `o_proj`, an MLP's up projection before its down projection.
    Every other linear (a router, a latent's down-projection, a shortcut) stays whole.
    `kept`: linears the source reads as weights, which stay plain torch layers."""
    import torch
    from torch import nn

    linears = [n for n, c in module.named_children() if isinstance(c, nn.Linear)]
    if not linears:
        return "it holds no linear of its own"
    if call is None:
        return "the tiny model never calls it"
    args, kwargs, _ = call

    def run(perturbed: str | None):
        seen: dict[str, list] = {n: [] for n in linears}
        hooks = []
        for n in linears:
            child = getattr(module, n)
            hooks.append(
                child.register_forward_pre_hook(
                    lambda _m, a, n=n: seen[n].append(a[0].detach().clone())
                )
            )
            if n == perturbed:
                hooks.append(
                    child.register_forward_hook(
                        lambda _m, _a, out: out + torch.randn_like(out)
                    )
                )
        try:
            with torch.no_grad():
                torch.manual_seed(0)
                out = _first(module(*copy.deepcopy(args), **copy.deepcopy(kwargs)))
        finally:
            for h in hooks:
                h.remove()
        return seen, out

    try:
        base, out = run(None)
        if any(len(v) != 1 for v in base.values() if v):
            return "a linear is called more than once"
        called = [n for n in linears if base[n]]
        feeds: dict[str, set[str]] = {}
        reaches: set[str] = set()
        for n in called:
            seen, got = run(n)
            feeds[n] = {
                r for r in called if r != n and not torch.equal(seen[r][0], base[r][0])
            }
            if not torch.equal(got, out):
                reaches.add(n)
    except Exception as exc:  # noqa: BLE001 - a class that cannot rerun alone
        return f"it cannot be rerun alone ({type(exc).__name__})"
    fed_by = {r: {n for n in called if r in feeds[n]} for r in called}
    # directly: not only through another linear it feeds
    direct = {
        r: {n for n in fed_by[r] if not any(r in feeds[k] for k in feeds[n])}
        for r in called
    }
    rowwise = {r for r in reaches if fed_by[r] and not feeds[r]}
    if not rowwise:
        return "no linear feeds another on the way to its output"
    colwise = set().union(*(direct[r] for r in rowwise))
    if (colwise | rowwise) & kept:
        return f"the source reads {', '.join(sorted((colwise | rowwise) & kept))} as weights"
    return {
        **{n: "colwise" for n in called if n in colwise},
        **{n: "rowwise" for n in called if n in rowwise},
    }


def widths(
    module, styles: dict[str, str], head_attrs: list[str], kv_attrs=()
) -> list[str]:
    """The module's integer attributes that count a sharded width whole (`self.embed_dim`
    in `attn_output.reshape(bsz, tokens, self.embed_dim)`): those equal to a column-
    parallel linear's outputs, or a row-parallel one's inputs, or a [q; k; v] linear's
    query width (its kv width too where the kv heads split). Candidates only: the
    proof decides whether dividing them over the ranks computes the same."""
    sizes = set()
    for attr, style in styles.items():
        linear = getattr(module, attr, None)
        if linear is None:  # a layer that does not build it (a kv-shared layer's v)
            continue
        if style == QKV:
            layout = qkv_layout(module, attr, head_attrs, kv_attrs)
            if layout is not None:
                heads, kv_heads, size = layout
                sizes.add(heads * size)
                if kv_heads % RANKS == 0:
                    sizes.add(kv_heads * size)
        elif is_column(style):
            sizes.add(linear.out_features)
            if style.startswith(PACKED):
                sizes.add(linear.out_features // int(style.removeprefix(PACKED)))
        elif style == "rowwise":
            sizes.add(linear.in_features)
    return [
        a
        for a, v in vars(module).items()
        if type(v) is int
        and v in sizes
        and a not in head_attrs
        and not a.startswith("_")
    ]


def _rank_inputs(module, head_attrs, call, rank: int):
    """(args, kwargs) one rank's copy receives: an input shaped per head (its leading
    dimension the batch times the class's head count: BLOOM's ALiBi biases, one row per
    head) split over the ranks as the heads are; every other input whole."""
    import torch

    args, kwargs, _ = call
    heads = [getattr(module, a) for a in head_attrs]
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None:
        first = next((a for a in kwargs.values() if isinstance(a, torch.Tensor)), None)
    batch = first.shape[0] if first is not None and first.dim() else None

    def mine(value):
        if not isinstance(value, torch.Tensor) or batch is None or value.dim() < 2:
            return copy.deepcopy(value)
        for h in heads:
            if value is not first and value.shape[0] == batch * h and h % RANKS == 0:
                rows = value.reshape(batch, h, *value.shape[1:])
                part = rows.chunk(RANKS, 1)[rank]
                return part.reshape(-1, *value.shape[1:]).clone()
        return copy.deepcopy(value)

    return [mine(a) for a in args], {k: mine(v) for k, v in kwargs.items()}


def _first(out):
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def prove(
    module, styles: dict[str, str], head_attrs: list[str], call, sinks=None, kv_attrs=()
) -> str | None:
    """None when `module` computes the same sharded over two ranks, else the reason.
    `kv_attrs`: the kv head counts among `head_attrs` (replicated where a [q; k; v]
    linear holds fewer kv heads than ranks)."""
    import threading

    import torch

    sharded = {a: s for a, s in styles.items() if is_column(s) or s == "rowwise"}
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
                shard = _shard(
                    module, sharded, head_attrs, sinks, rank, reduce, kv_attrs
                )
                rank_args, rank_kwargs = _rank_inputs(module, head_attrs, call, rank)
                outs[rank] = _first(shard(*rank_args, **rank_kwargs))
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
