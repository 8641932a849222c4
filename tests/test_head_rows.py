"""A sharded attention's per-head parameters (Cohere's q/k norms: a [heads, head_dim]
weight) hold this rank's heads' rows, where the submodule is proven to compute each head
from its own row (engine-free)."""

from __future__ import annotations

import torch
from torch import nn

from codemods.copying import head_rows


class PerHeadNorm(nn.Module):  # Cohere's LayerNorm over head_dim, a weight row per head
    def __init__(self, heads, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x - mean).pow(2).mean(-1, keepdim=True)
        return self.weight * (x - mean) * torch.rsqrt(var + 1e-5)


class MixesHeads(PerHeadNorm):  # every head scaled by the mean of all rows
    def forward(self, x):
        return super().forward(x) * self.weight.mean(0)


def _call(module, heads=4, dim=8):
    x = torch.randn(3, heads, dim)
    return (x,), {}, module(x)


def test_a_per_head_norm_is_proven_and_one_mixing_heads_is_not():
    norm = PerHeadNorm(4, 8)
    assert head_rows._per_head(norm, ["weight"], _call(norm))
    mixed = MixesHeads(4, 8)
    # the probe's weights are all ones, where both compute the same: the proof draws
    # its own rows
    assert not head_rows._per_head(mixed, ["weight"], _call(mixed))


def _helper(rank: int, tp: int):
    space = {
        "nn": nn,
        "get_tensor_model_parallel_world_size": lambda: tp,
        "get_tensor_model_parallel_rank": lambda: rank,
    }
    exec(head_rows.HELPER, space)
    return space["shard_head_rows"]


def test_each_rank_holds_its_heads_rows_and_loads_them():
    checkpoint = torch.arange(4 * 3, dtype=torch.float32).view(4, 3)
    for tp, rank, want in [(2, 0, [0, 1]), (2, 1, [2, 3]), (1, 0, [0, 1, 2, 3])]:
        owner = nn.Module()
        owner.q_norm = PerHeadNorm(4, 3)
        _helper(rank, tp)(owner, "q_norm", "weight")
        param = owner.q_norm.weight
        param.weight_loader(param, checkpoint)
        assert torch.equal(param, checkpoint[want]), (tp, rank)


def test_kv_heads_fewer_than_ranks_follow_the_replicated_kv_projection():
    """QKVParallelLinear with 2 kv heads on 4 ranks: ranks 0-1 hold kv head 0, 2-3
    head 1."""
    checkpoint = torch.tensor([[10.0], [20.0]])
    for rank, want in enumerate([10.0, 10.0, 20.0, 20.0]):
        owner = nn.Module()
        owner.k_norm = PerHeadNorm(2, 1)
        _helper(rank, 4)(owner, "k_norm", "weight")
        owner.k_norm.weight.weight_loader(owner.k_norm.weight, checkpoint)
        assert owner.k_norm.weight.tolist() == [[want]]


def test_a_module_built_only_under_an_off_flag_is_skipped():
    owner = nn.Module()
    owner.q_norm = None
    _helper(0, 2)(owner, "q_norm", "weight")  # no error
    assert owner.q_norm is None


def test_the_calls_go_at_the_end_of_init():
    text = (
        "class A(nn.Module):\n"
        "    def __init__(self):\n"
        "        self.q_norm = N()\n"
        "\n"
        "    def forward(self, x):\n"
        "        return x\n"
    )
    out = head_rows.shard_in_init(text, "A", {"q_norm": ["weight"]})
    assert (
        "        self.q_norm = N()\n"
        "        # tensor parallel: q_norm: a row per head, this rank's heads' rows\n"
        "        shard_head_rows(self, 'q_norm', 'weight')\n"
    ) in out
    assert out.count("shard_head_rows") == 1
