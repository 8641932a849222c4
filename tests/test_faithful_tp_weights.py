"""Engine-free, two tensor-parallel ranks, faithful files: every linear of every rank
holds exactly its slice of the transformers weights (column-parallel: its rows,
row-parallel: its columns, merged q/k/v and gate/up: shard by shard, replicated: all),
and sharded attention sinks their heads' slice."""

from __future__ import annotations

import importlib
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conftest import load_on_rank

from codemods import tiny

TP = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, model: str, causal: str, ckpt: str, out: str) -> None:
    from vllm.model_executor.layers.linear import LinearBase

    cls = getattr(importlib.import_module(f"generated.{model}"), causal)
    vllm_model, weights = load_on_rank(cls, ckpt, rank, port, TP)
    # before process_weights_after_loading, which repacks CPU weights
    linears = {
        name: (
            type(mod).__name__,
            mod.weight.detach().clone(),
            (None if getattr(mod, "bias", None) is None else mod.bias.detach().clone()),
        )
        for name, mod in vllm_model.named_modules()
        if isinstance(mod, LinearBase)
    }
    sinks = {
        name: p.detach().clone()
        for name, p in vllm_model.named_parameters()
        if name.endswith(".sinks")
    }
    torch.save(
        {
            "linears": linears,
            "sinks": sinks,
            "packed": vllm_model.packed_modules_mapping,
        },
        f"{out}/rank{rank}.pt",
    )


def _expected(kind, name, hf, packed, rank, config, which="weight"):
    """The transformers tensor this rank's `name` must hold."""
    attr = name.rsplit(".", 1)[-1]

    def ref(n):
        return hf[f"{n}.{which}"]

    if kind == "ReplicatedLinear":
        return ref(name)
    if kind == "ColumnParallelLinear":
        return ref(name).chunk(TP, 0)[rank]
    if kind == "RowParallelLinear":
        return ref(name) if which == "bias" else ref(name).chunk(TP, 1)[rank]
    sources = [name[: -len(attr)] + s for s in packed[attr]]
    if kind == "MergedColumnParallelLinear":
        return torch.cat([ref(s).chunk(TP, 0)[rank] for s in sources])
    if kind == "QKVParallelLinear":
        q, k, v = (ref(s) for s in sources)
        kv_heads = config.num_key_value_heads
        if kv_heads >= TP:
            return torch.cat(
                [q.chunk(TP, 0)[rank], k.chunk(TP, 0)[rank], v.chunk(TP, 0)[rank]]
            )
        head = rank * kv_heads // TP
        size = k.shape[0] // kv_heads
        return torch.cat(
            [
                q.chunk(TP, 0)[rank],
                k[head * size : (head + 1) * size],
                v[head * size : (head + 1) * size],
            ]
        )
    raise AssertionError(f"unexpected linear {kind} at {name}")


@pytest.mark.parametrize(
    "model,causal",
    [
        ("granite_swa", "GraniteSWAForCausalLM"),
        ("phi", "PhiForCausalLM"),
        ("afmoe", "AfmoeForCausalLM"),
        ("gpt2", "GPT2LMHeadModel"),
    ],
)
def test_each_rank_holds_its_slice(tmp_path, model, causal):
    source = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    hf_cls = getattr(source, causal)
    config = hf_cls.config_class(**tiny.working_values(hf_cls))
    ckpt = tmp_path / "ckpt"
    hf_model = tiny.build_checkpoint(hf_cls, config, ckpt)
    hf = hf_model.state_dict()
    mp.start_processes(
        _rank,
        args=(_free_port(), model, causal, str(ckpt), str(tmp_path)),
        nprocs=TP,
        start_method="spawn",
    )
    sharded = 0
    for rank in range(TP):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["linears"] or model == "gpt2", "no vLLM linears"
        for name, (kind, weight, bias) in got["linears"].items():
            if kind not in ("ReplicatedLinear",):
                sharded += 1
            want = _expected(kind, name, hf, got["packed"], rank, config)
            assert torch.equal(weight, want), (model, name, kind, rank)
            if bias is not None:
                want_b = _expected(kind, name, hf, got["packed"], rank, config, "bias")
                assert torch.equal(bias, want_b), (model, name, kind, rank, "bias")
        for name, value in got["sinks"].items():
            assert torch.equal(value, hf[name].chunk(TP, 0)[rank]), (model, name, rank)
    if model != "gpt2":  # gpt2 has no TP plan: replicated everywhere
        assert sharded > 0
