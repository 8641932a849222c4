"""Engine-free, two tensor-parallel ranks: each rank's slice of the merged q/k/v and
gate/up weights equals the matching slices of the transformers weights, shard by shard
(the sharding trap: a contiguous split of the merged matrix would give rank 0 only q rows).
Covers kv heads split across ranks and kv heads replicated (fewer kv heads than ranks).
"""

from __future__ import annotations

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


def _rank(rank: int, port: int, ckpt: str, out: str) -> None:
    from generated.qwen3 import Qwen3ForCausalLM

    model, _ = load_on_rank(Qwen3ForCausalLM, ckpt, rank, port, TP)
    # before process_weights_after_loading, which repacks CPU weights
    layer = model.model.layers[0]
    torch.save(
        {
            "qkv": layer.self_attn.qkv_proj.weight.detach().clone(),
            "qkv_bias": layer.self_attn.qkv_proj.bias.detach().clone(),
            "gate_up": layer.mlp.gate_up_proj.weight.detach().clone(),
            "down": layer.mlp.down_proj.weight.detach().clone(),
        },
        f"{out}/rank{rank}.pt",
    )


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_each_rank_holds_its_own_shards(tmp_path, kv_heads):
    from transformers import Qwen3ForCausalLM

    config = tiny.tiny_config(
        Qwen3ForCausalLM.config_class, {"num_key_value_heads": kv_heads}
    )
    ckpt = tmp_path / "ckpt"
    hf = tiny.build_checkpoint(Qwen3ForCausalLM, config, ckpt)
    mp.start_processes(
        _rank,
        args=(_free_port(), str(ckpt), str(tmp_path)),
        nprocs=TP,
        start_method="spawn",
    )

    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    hd = config.head_dim
    q_rows = config.num_attention_heads * hd // TP
    kv_total = config.num_key_value_heads * hd
    for rank in range(TP):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        q = attn.q_proj.weight[rank * q_rows : (rank + 1) * q_rows]
        if config.num_key_value_heads >= TP:
            kv_rows = kv_total // TP
            k = attn.k_proj.weight[rank * kv_rows : (rank + 1) * kv_rows]
            v = attn.v_proj.weight[rank * kv_rows : (rank + 1) * kv_rows]
        else:  # replicated: every rank holds the kv head its q heads attend to
            head = rank * config.num_key_value_heads // TP
            k = attn.k_proj.weight[head * hd : (head + 1) * hd]
            v = attn.v_proj.weight[head * hd : (head + 1) * hd]
        assert torch.equal(got["qkv"], torch.cat([q, k, v]))
        inter = config.intermediate_size // TP
        gate = mlp.gate_proj.weight[rank * inter : (rank + 1) * inter]
        up = mlp.up_proj.weight[rank * inter : (rank + 1) * inter]
        assert torch.equal(got["gate_up"], torch.cat([gate, up]))
        assert torch.equal(
            got["down"], mlp.down_proj.weight[:, rank * inter : (rank + 1) * inter]
        )
        # a contiguous split of the merged matrix would not match: the trap is visible
        merged = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        assert not torch.equal(got["qkv"], merged.chunk(TP)[rank])
