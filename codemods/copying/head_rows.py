"""Per-head parameters inside a sharded attention: a submodule holding one row per head
(Cohere's q/k norms: a `[heads, head_dim]` LayerNorm weight) holds this rank's heads'
rows, where it is proven that the submodule computes each head from that head's row
alone. Without this a rank's `[heads / tp, head_dim]` query meets the whole weight."""

from __future__ import annotations

import copy

import libcst as cst
import torch

HELPER = '''
def shard_head_rows(owner: nn.Module, attr: str, *names: str) -> None:
    """`owner.<attr>`'s parameters `names` hold one row per head: this rank keeps the rows
    of the heads its q/k/v projections hand it (a kv head replicated over ranks when
    there are fewer kv heads than ranks), and loads the checkpoint's rows for them."""
    module = getattr(owner, attr, None)
    if module is None:  # built only under a config flag that is off
        return
    tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    for name in names:
        whole = getattr(module, name)
        total = whole.shape[0]
        start, rows = rank * total // tp, max(1, total // tp)
        param = nn.Parameter(
            whole.data[start : start + rows].clone(), requires_grad=False
        )
        param.weight_loader = lambda p, w, s=start, n=rows: p.data.copy_(w[s : s + n])
        setattr(module, name, param)
'''


def shard_in_init(text: str, cls: str, rows: dict[str, list[str]]) -> str:
    """The class `cls` in `text` with `shard_head_rows` calls at the end of its
    `__init__`, where this rank's width is known (a no-op at TP=1)."""
    lines = [
        f"# tensor parallel: {', '.join(rows)}: a row per head, this rank's heads' rows",
        *(
            f"shard_head_rows(self, {a!r}, " + ", ".join(map(repr, names)) + ")"
            for a, names in rows.items()
        ),
    ]
    from .classes import _append

    def init_extended(stmt):
        if not isinstance(stmt, cst.FunctionDef) or stmt.name.value != "__init__":
            return stmt
        return stmt.with_changes(body=_append(stmt.body, lines))

    def extended(stmt):
        if not isinstance(stmt, cst.ClassDef) or stmt.name.value != cls:
            return stmt
        body = [init_extended(s) for s in stmt.body.body]
        return stmt.with_changes(body=stmt.body.with_changes(body=body))

    module = cst.parse_module(text)
    return module.with_changes(body=[extended(s) for s in module.body]).code


def per_head_parameters(model, cls: str) -> dict[str, list[str]]:
    """{attribute: parameter names} of `cls`'s submodules whose parameters hold a row
    per query or kv head, on every instance the tiny model builds, proven per head."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    counts = {heads, getattr(config, "num_key_value_heads", None) or heads} - {None}
    found: dict[str, list[str]] = {}
    for _, inst in model.probe.instances.get(cls, []):
        for attr, child in inst.named_children():
            names = [
                n
                for n, p in child.named_parameters(recurse=False)
                if p.dim() >= 2 and p.shape[0] in counts
            ]
            if not names or any(True for _ in child.children()):
                continue
            if _per_head(child, names, model.call(child)):
                found.setdefault(attr, names)
            else:
                found[attr] = []  # one instance that mixes heads: not sharded
    return {a: n for a, n in found.items() if n}


def _per_head(child, names: list[str], call) -> bool:
    """With random rows in `names`, the child on its input's first and last heads, with
    those heads' rows, gives those heads' part of its whole output."""
    if call is None:
        return False
    args, kwargs, _ = call
    if not args or not isinstance(args[0], torch.Tensor) or kwargs:
        return False
    x = args[0]
    rows = getattr(child, names[0]).shape[0]
    if rows < 2 or any(getattr(child, n).shape[0] != rows for n in names):
        return False
    whole = copy.deepcopy(child)
    gen = torch.Generator().manual_seed(0)
    for name in names:
        p = getattr(whole, name)
        p.data = 1 + torch.randn(p.shape, generator=gen, dtype=p.dtype) / 4
    with torch.no_grad():
        try:
            out = whole(x)
        except Exception:  # noqa: BLE001 - not a module of its input alone
            return False
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return False
    axes = [a for a in range(x.dim()) if x.shape[a] == rows]
    half = rows // 2
    for axis in sorted(axes, key=lambda a: a != x.dim() - 2):  # [..., heads, dim] first
        if all(
            _part_matches(whole, names, x, out, axis, s, half) for s in (0, rows - half)
        ):
            return True
    return False


def _part_matches(whole, names, x, out, axis, start, n) -> bool:
    part = copy.deepcopy(whole)
    for name in names:
        rows = getattr(whole, name).data[start : start + n].clone()
        setattr(part, name, torch.nn.Parameter(rows, requires_grad=False))
    with torch.no_grad():
        try:
            got = part(x.narrow(axis, start, n))
        except (
            Exception
        ):  # noqa: BLE001 - a module that cannot run on part of the heads
            return False
    want = out.narrow(axis, start, n)
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
