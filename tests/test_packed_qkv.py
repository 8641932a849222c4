"""One linear holding [q; k; v] with fewer kv heads than query heads (GPTBigCode's
multi-query `c_attn`, StarCoder's layout): vLLM's QKVParallelLinear, the query heads
split over the ranks and the one kv head replicated on each, proven by the class's
two-rank proof, sharded only on the config branches the proof ran
(`codemods/copying/packed_qkv.py`). Engine-free; the engine runs are gpt_bigcode's
verify at TP=2 (its coverage row) and `test_faithful_engine.py`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conftest import REPO

from fusion_patterns import sharding


class MultiQuery(nn.Module):
    """Query heads, then one key head and one value head, in one projection; `order`
    names the parts as the forward reads them (the checkpoint's order is q, k, v)."""

    def __init__(self, heads=4, size=4, order="qkv"):
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = heads, 1, size
        self.embed_dim, self.kv_dim = heads * size, size
        self.num_key_value_groups = heads
        self.order = order
        self.c_attn = nn.Linear(self.embed_dim, self.embed_dim + 2 * self.kv_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def forward(self, x):
        b, t, _ = x.shape
        sizes = {"q": self.embed_dim, "k": self.kv_dim, "v": self.kv_dim}
        parts = self.c_attn(x).split([sizes[p] for p in self.order], dim=-1)
        got = dict(zip(self.order, parts))
        q = got["q"].view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = (
            got[p].view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            for p in "kv"
        )
        k, v = (s.repeat_interleave(self.num_key_value_groups, 1) for s in (k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, self.embed_dim))


HEADS, KV = ["num_heads", "kv_heads"], ["kv_heads"]


def _proof(module):
    torch.manual_seed(0)
    for p in module.parameters():
        nn.init.normal_(p)
    x = torch.randn(1, 5, module.embed_dim)
    with torch.no_grad():
        call = (x,), {}, module(x)
    plan = sharding.derive(module, call)
    assert plan == {"c_attn": "colwise", "c_proj": "rowwise"}
    options = list(sharding.candidates(module, plan, HEADS, KV))
    assert options[-1] == {"c_attn": sharding.QKV, "c_proj": "rowwise"}

    def proven(option):
        wide = sharding.widths(module, option, HEADS, KV)
        return sharding.prove(module, option, HEADS + wide, call, kv_attrs=KV)

    return [proven(o) for o in options]


def test_one_kv_head_is_replicated_and_the_query_heads_split():
    *others, qkv = _proof(MultiQuery())
    # split as a plain or packed column-parallel linear, one kv head cannot divide
    assert all("kv_heads = 1 heads, not divisible by 2" in o for o in others), others
    assert qkv is None


def test_a_forward_reading_the_parts_in_another_order_is_refused():
    # the key first: the widths fit, the numbers do not
    *_, qkv = _proof(MultiQuery(order="kqv"))
    assert qkv is not None and "computes something else" in qkv, qkv


def _taken(info, built) -> list[str]:
    from codemods.copying.config_branches import decided_branches

    return [b.text() for b in decided_branches(info, built)]


def test_the_proof_holds_on_the_branch_the_tiny_config_takes():
    from codemods.source import load

    info = load("modeling_gpt_bigcode.py").classes["GPTBigCodeAttention"]

    class Built:  # the attributes the forward's config branches read
        multi_query = True
        is_cross_attention = False

    assert _taken(info, Built()) == ["config.multi_query"]
    Built.multi_query = False
    assert _taken(info, Built()) == ["not config.multi_query"]


def test_gpt_bigcode_shards_its_multi_query_attention_where_the_config_says():
    text = (REPO / "generated" / "gpt_bigcode.py").read_text()
    init = text[text.index("class GPTBigCodeAttention") :]
    init = init[: init.index("def forward")]
    # the self-attention's [q; k; v]; the cross-attention's keys and values stay whole
    assert init.count("QKVParallelLinear(") == 1
    assert (
        "self.c_attn = ReplicatedLinear(\n                self.embed_dim,\n                2 * self.embed_dim,"
        in init
    )
    assert init.count("disable_tp=not config.multi_query,") == 2  # c_attn, c_proj
    assert (
        "tp_size = get_tensor_model_parallel_world_size() if config.multi_query else 1"
        in init
    )
    assert "self.kv_heads = max(1, self.kv_heads // tp_size)" in init
    assert (
        "#   Fused: c_attn (GPTBigCodeAttention) -> c_attn (QKVParallelLinear" in text
    )


@pytest.mark.parametrize("kv, want", [(1, (4, 1, 8)), (2, (4, 2, 8)), (3, None)])
def test_the_layout_needs_kv_heads_that_divide_or_are_divided_by_the_ranks(kv, want):
    module = MultiQuery(heads=4, size=8)
    module.kv_heads = kv
    module.c_attn = nn.Linear(32, 32 + 2 * kv * 8)
    assert sharding.qkv_layout(module, "c_attn", HEADS, KV) == want


def test_branches_in_a_helper_method_are_read_too():
    # Falcon picks its fused layout in `_split_heads`, not in forward: a proof on the
    # tiny config's layout covers only the configs taking the same branches
    from codemods.source import load

    info = load("modeling_falcon.py").classes["FalconAttention"]

    class Built:
        new_decoder_architecture, multi_query = False, True

    assert _taken(info, Built()) == [
        "not config.new_decoder_architecture",
        "config.multi_query",
    ]


def test_falcon_divides_the_kv_heads_its_weights_hold_on_the_layout_proven():
    """Falcon's new decoder architecture holds grouped [q..., k, v] per kv head and
    broadcasts keys and values to every query head: a rank's contiguous share is its
    groups once `num_kv_heads` is divided too, whatever `multi_query` says (proven with
    it flipped). Falcon-7B's multi-query and Falcon-RW's per-head layouts take other
    branches of `_split_heads`: the proof fails there, so whole on every rank (both
    verified at TP=2 with `--override new_decoder_architecture=false`)."""
    text = (REPO / "generated" / "falcon.py").read_text()
    init = text[text.index("class FalconAttention") :]
    init = init[: init.index("def forward")]
    taken = "config.new_decoder_architecture"
    assert "self.query_key_value = ColumnParallelLinear(" in init
    assert init.count(f"disable_tp=not {taken},") == 2  # query_key_value, dense
    # read before the head counts are divided (the Attention's kv heads, once)
    lines = [line.strip() for line in init.splitlines()]
    at = lines.index("total_kv_heads = (")
    assert at < lines.index("self.num_heads = self.num_heads // tp_size")
    assert "num_kv_heads=total_kv_heads // tp_size," in lines
    assert "self.num_kv_heads = self.num_kv_heads // tp_size" in lines
    assert (
        f"#   Unfused: tensor parallel (FalconAttention): sharded where `{taken}` "
        "(proven there), whole on every rank elsewhere: with "
        "config.new_decoder_architecture=False over 2 ranks it fails"
    ) in text
