"""Tensor parallelism for copied classes without a transformers TP plan
(`fusion_patterns/sharding.py`): the plan measured from the class's dataflow, packed
projections, widths the source counts whole, transformers' `Conv1D`. Engine-free: the
plan, its two-rank proof, and what the generated files hold; the engine runs are the TP
tests (`test_faithful_engine.py`), the loaded shards `test_faithful_tp_weights.py`."""

from __future__ import annotations

import ast

import pytest
import torch
from torch import nn

from conftest import REPO

from codemods.apply import generate
from fusion_patterns import sharding


class MLP(nn.Module):
    def __init__(self, width=8, inner=16):
        super().__init__()
        self.up = nn.Linear(width, inner)
        self.down = nn.Linear(inner, width)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Attention(nn.Module):
    """q/k/v before attention, o after it; a gate beside them; heads counted in reshapes."""

    def __init__(self, width=8, heads=4, packed=False):
        super().__init__()
        self.num_heads, self.embed_dim, self.split_size = heads, width, width
        self.packed = packed
        if packed:
            self.c_attn = nn.Linear(width, 3 * width)
        else:
            self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)

    def forward(self, x):
        if self.packed:
            q, k, v = self.c_attn(x).split(self.split_size, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        b, t, _ = x.shape
        q, k, v = (s.view(b, t, self.num_heads, -1).transpose(1, 2) for s in (q, k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, self.embed_dim))


class Latent(nn.Module):
    """A down-projection before the up-projection (MLA's kv_a -> kv_b): only the pair
    around the activation is sharded, the first linear stays whole."""

    def __init__(self, width=8):
        super().__init__()
        self.a = nn.Linear(width, 4)
        self.b = nn.Linear(4, 16)
        self.o = nn.Linear(16, width)

    def forward(self, x):
        return self.o(torch.relu(self.b(self.a(x))))


def _call(module, *args):
    torch.manual_seed(0)
    for p in module.parameters():
        nn.init.normal_(p)
    with torch.no_grad():
        return args, {}, module(*args)


def test_the_dataflow_gives_megatron_pairs():
    x = torch.randn(1, 5, 8)
    mlp = MLP()
    assert sharding.derive(mlp, _call(mlp, x)) == {"up": "colwise", "down": "rowwise"}
    att = Attention()
    assert sharding.derive(att, _call(att, x)) == {
        "q": "colwise",
        "k": "colwise",
        "v": "colwise",
        "o": "rowwise",
    }
    latent = Latent()
    assert sharding.derive(latent, _call(latent, x)) == {
        "b": "colwise",
        "o": "rowwise",
    }


def test_no_plan_says_why():
    x = torch.randn(1, 5, 8)
    router = nn.Sequential()
    router.gate = nn.Linear(8, 4)
    router.forward = lambda h: router.gate(h).softmax(-1)
    assert "no linear feeds another" in sharding.derive(router, _call(router, x))
    mlp = MLP()
    assert "reads down as weights" in sharding.derive(mlp, _call(mlp, x), {"down"})
    assert "never calls it" in sharding.derive(mlp, None)


def test_a_derived_plan_is_proven_or_refused():
    x = torch.randn(1, 5, 8)
    att = Attention()
    call = _call(att, x)
    plan = sharding.derive(att, call)
    assert sharding.prove(att, plan, ["num_heads"], call) is not None  # embed_dim whole
    widths = sharding.widths(att, plan, ["num_heads"])
    assert widths == ["embed_dim", "split_size"]
    assert sharding.prove(att, plan, ["num_heads", *widths], call) is None
    # a plan that shards the wrong side fails the proof
    wrong = {"q": "rowwise", "k": "rowwise", "v": "rowwise", "o": "colwise"}
    assert sharding.prove(att, wrong, ["num_heads", *widths], call) is not None


def test_a_packed_projection_is_sharded_part_by_part():
    x = torch.randn(1, 5, 8)
    att = Attention(packed=True)
    call = _call(att, x)
    plan = sharding.derive(att, call)
    assert plan == {"c_attn": "colwise", "o": "rowwise"}
    heads = ["num_heads", *sharding.widths(att, plan, ["num_heads"])]
    options = list(sharding.candidates(att, plan))
    assert options[1] == {"c_attn": "colwise_packed_3", "o": "rowwise"}
    # plain colwise gives rank 0 all of q and half of k: it fails; 3 parts pass
    assert sharding.prove(att, options[0], heads, call) is not None
    assert sharding.prove(att, options[1], heads, call) is None


def test_conv1d_is_seen_as_the_linear_it_computes():
    from transformers.pytorch_utils import Conv1D

    holder = nn.Module()
    holder.c_fc = Conv1D(16, 8)
    nn.init.normal_(holder.c_fc.weight)
    x = torch.randn(2, 8)
    seen = sharding.as_linears(holder)
    assert isinstance(seen.c_fc, nn.Linear) and seen.c_fc.out_features == 16
    assert torch.allclose(seen.c_fc(x), holder.c_fc(x), atol=1e-6)
    assert isinstance(holder.c_fc, Conv1D)  # the probe's instance is untouched


def _linears(text: str, cls: str) -> dict[str, str]:
    """{attr: the vLLM class it is built as} in `cls.__init__` of a generated file."""
    tree = ast.parse(text)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for a in ast.walk(node):
        if isinstance(a, ast.Assign) and isinstance(a.value, ast.Call):
            target = a.targets[0]
            call = a.value
            if call.func.__class__ is ast.Name and call.func.id == "conv1d_layout":
                call = call.args[0]
            if isinstance(target, ast.Attribute) and isinstance(call.func, ast.Name):
                if call.func.id.endswith("Linear"):
                    out[target.attr] = call.func.id
    return out


@pytest.mark.parametrize(
    "source,layer,attention,mlp",
    [
        # a decoder layer holding its MLP's linears itself; q is scaled by a constant
        ("modeling_opt.py", "OPTDecoderLayer", "OPTAttention", None),
        # transformers' Conv1D, a packed q|k|v split by a width the class holds
        ("modeling_gpt2.py", None, "GPT2Attention", "GPT2MLP"),
    ],
)
def test_files_without_a_tp_plan_are_sharded(source, layer, attention, mlp):
    plan, text = generate(source)
    report = plan.report()
    # nothing the tiny model runs is whole on every rank (GPT-2's cross-attention
    # branch, never built for a decoder, keeps its layers whole and says so)
    whole = [line for line in report if "tensor parallel" in line]
    assert all("a branch the tiny model does not take" in line for line in whole), whole
    att = _linears(text, attention)
    assert "RowParallelLinear" in att.values()
    for attr in (a for a, c in att.items() if c == "ReplicatedLinear"):
        assert any(f" {attr}" in line for line in whole), (attr, whole)
    assert set(att.values()) & {"ColumnParallelLinear", "MergedColumnParallelLinear"}
    for cls in (layer, mlp):
        if cls:
            assert sorted(_linears(text, cls).values()) == [
                "ColumnParallelLinear",
                "RowParallelLinear",
            ]
    assert "get_tensor_model_parallel_world_size()" in text


def test_gpt2_loads_conv1d_weights_transposed():
    _, text = generate("modeling_gpt2.py")
    assert "from transformers.pytorch_utils import Conv1D" not in text
    assert text.count("conv1d_layout(") >= 5  # the helper and four layers
    att = _linears(text, "GPT2Attention")
    assert att["c_attn"] == "MergedColumnParallelLinear"


def test_torch_linears_left_in_the_file_are_said():
    """CTRL builds its feed-forward in a module-level function (`nn.Sequential` of torch
    linears), which the file keeps: whole on every rank, and the report says so."""
    plan, text = generate("modeling_ctrl.py")
    assert "nn.Linear(d_model_size, dff)" in text
    assert (
        "Unfused: tensor parallel (point_wise_feed_forward_network): 2 torch nn.Linear "
        "kept as the source builds it: whole on every rank, outside vLLM's quantization "
        "and LoRA"
    ) in plan.report()


def test_linears_a_pattern_emits_whole_are_said():
    """A class a pattern emits whole that holds linears whole on every rank says so:
    kept with vLLM's own file's reason where the pattern gives one (latent attention's
    down-projections), a slow path under TP where it gives none."""
    from codemods.copying import _emitted_whole
    from fusion_patterns.base import Pattern
    from fusion_patterns.mla import LatentAttention

    text = (
        "class A(nn.Module):\n"
        "    def __init__(self):\n"
        "        self.a = ReplicatedLinear(8, 8)\n"
        "        self.b = MergedColumnParallelLinear(8, [4, 4], disable_tp=True)\n"
        "        self.c = ColumnParallelLinear(8, 8, disable_tp=False)\n"
        "        self.d = RowParallelLinear(8, 8)\n"
    )
    kept = _emitted_whole("A", text, LatentAttention())
    assert kept.kept and kept.describe().startswith(
        "Kept: tensor parallel (A): a, b whole on every rank: the latent's "
        "down-projections, as vLLM's own deepseek_v2.py holds them"
    )
    slow = _emitted_whole("A", text, Pattern())
    assert not slow.kept and slow.describe() == (
        "Unfused: tensor parallel (A): replicated on every rank: a, b (as the pattern "
        "emits them)"
    )
    sharded = (
        "class B:\n    def __init__(self):\n        self.d = RowParallelLinear(8, 8)\n"
    )
    assert _emitted_whole("B", sharded, Pattern()) is None
    committed = (REPO / "generated" / "deepseek_v3.py").read_text().split('"""')[0]
    assert (
        "#   Kept: tensor parallel (DeepseekV3Attention): fused_qkv_a_proj, "
        in committed
    )


class BiasedAttention(Attention):
    """Attention adding a per-head bias the caller builds (BLOOM's ALiBi: one row per
    head, [batch * heads, 1, tokens]); `whole` reads the bias as a whole instead."""

    def __init__(self, whole=False):
        super().__init__()
        self.whole = whole

    def forward(self, x, bias):
        b, t, _ = x.shape
        q, k, v = (
            s(x).view(b, t, self.num_heads, -1).transpose(1, 2)
            for s in (self.q, self.k, self.v)
        )
        if self.whole:  # every head gets the mean over all heads' rows: not per head
            bias = bias.mean(0, keepdim=True).expand(b * self.num_heads, 1, t)
        scores = q @ k.transpose(-1, -2) + bias.view(b, self.num_heads, 1, t)
        out = scores.softmax(-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, self.embed_dim))


@pytest.mark.parametrize("whole", [False, True])
def test_an_input_shaped_per_head_is_split_as_the_heads_are(whole):
    """The proof hands each rank its heads' rows of an input shaped per head; a class
    that reads such an input whole computes something else sharded and is refused."""
    x, bias = torch.randn(2, 5, 8), torch.randn(2 * 4, 1, 5)
    att = BiasedAttention(whole=whole)
    call = _call(att, x, bias)
    plan = sharding.derive(att, call)
    assert plan == {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
    heads = ["num_heads", *sharding.widths(att, plan, ["num_heads"])]
    failed = sharding.prove(att, plan, heads, call)
    assert (failed is None) is (not whole), failed
