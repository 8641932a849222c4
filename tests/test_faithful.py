"""Copied classes, engine-free: what the copy folds and keeps, what the probes read from
real sources, and where it refuses. `--disable attention` keeps the source's attention
class as it computes it, so the copy itself is what these tests see."""

from __future__ import annotations

import re
import textwrap

import libcst as cst
import pytest

from conftest import edited_modeling_file, run_cli

from codemods.copying.simplify import simplify_function


def _fold(src: str, known=None, not_none=frozenset()) -> str:
    func = cst.parse_module(textwrap.dedent(src)).body[0]
    return cst.Module(body=[simplify_function(func, known, not_none)]).code


def test_inference_facts_fold_the_cache_and_training_paths_away():
    out = _fold(
        """
        def forward(self, x, past_key_values=None, use_cache=False):
            if past_key_values is not None:
                x = past_key_values.update(x)
            use_cache = use_cache if use_cache is not None else self.config.use_cache
            if use_cache and self.training:
                raise ValueError("no")
            y = self.drop(x) if self.training else x
            return y
        """,
        {"past_key_values": "None", "use_cache": "False"},
    )
    assert "past_key_values.update" not in out
    assert "raise" not in out
    assert "y = x" in out


def test_a_known_name_the_function_rebinds_is_not_folded():
    # bloom: `attention_mask = torch.ones(...)` when none is given; its later reads keep it
    out = _fold(
        """
        def forward(self, attention_mask=None):
            if attention_mask is None:
                attention_mask = torch.ones(3)
            return build(attention_mask)
        """,
        {"attention_mask": "None"},
    )
    assert "build(attention_mask)" in out


def test_folded_masks_and_their_methods_become_none():
    out = _fold("""
        def forward(self, x):
            mask = None.to(torch.bool)
            sub = mask[:, :3]
            return self.layer(x, mask=sub)
        """)
    assert "self.layer(x, mask=None)" in out


def test_known_not_none_names_decide_their_tests():
    out = _fold(
        """
        def forward(self, position_ids):
            if position_ids is None:
                position_ids = torch.arange(3)
            return position_ids
        """,
        not_none={"position_ids"},
    )
    assert "arange" not in out


@pytest.fixture(scope="module")
def faithful_llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("faithful")
    result = run_cli(
        "codemods.apply",
        "modeling_llama.py",
        "--disable",
        "attention",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    return result.stderr, (out / "llama.py").read_text()


def test_faithful_llama_keeps_the_source_and_fuses_the_proven_parts(faithful_llama):
    report, text = faithful_llama
    # fused where proven, per part
    for line in (
        "Fused: q_proj + k_proj + v_proj (LlamaAttention) -> qkv_proj (QKVParallelLinear)",
        "Fused: gate_proj + up_proj (LlamaMLP) -> gate_up_proj (MergedColumnParallelLinear)",
        "Fused: input_layernorm (LlamaDecoderLayer) -> input_layernorm (RMSNorm)",
    ):
        assert line in report
    # the copied attention's rope is vLLM's on vLLM's positions (the rope pattern acts
    # on the copy); the source's rotary module, nothing reading its tables, is gone
    assert (
        "Fused: apply_rotary_pos_emb (LlamaAttention) -> rotary_emb (get_rope, NeoX halves)"
        in report
    )
    assert "class LlamaRotaryEmbedding(nn.Module):" not in text
    assert "def apply_rotary_pos_emb(" not in text
    # the rest as the source computes it, reported; its attention call handed to vLLM
    assert "Unfused: attention (LlamaAttention)" in report
    assert "vllm_attention(self.attn, query_states, key_states, value_states)" in text
    assert "ALL_ATTENTION_FUNCTIONS" not in text
    assert "past_key_values.update" not in text and "DynamicCache" not in text
    # transformers' plumbing gone
    for gone in ("GradientCheckpointingLayer", "@auto_docstring", "create_causal_mask"):
        assert gone not in text


def apply_faithful(path, out):
    return run_cli(
        "codemods.apply",
        str(path),
        "--disable",
        "attention",
        "--trust-remote-code",
        "--out",
        str(out),
    )


def test_an_attention_that_counts_all_heads_in_a_reshape_is_replicated(tmp_path):
    """`view(bsz, q_len, config.num_attention_heads, -1)` holds only unsharded: the
    simulated two-rank run fails, so the class is replicated (and says why)."""
    path = edited_modeling_file(
        tmp_path,
        "modeling_llama.py",
        "attn_output = attn_output.reshape(*input_shape, -1).contiguous()",
        "attn_output = attn_output.reshape(*input_shape, self.config.num_attention_heads * self.head_dim).contiguous()",
    )
    result = apply_faithful(path, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert (
        "Unfused: tensor parallel (LlamaAttention): replicated: sharded over 2 ranks it fails"
        in result.stderr
    )
    text = (tmp_path / "out" / "llama.py").read_text()
    # q/k/v may still be one GEMM, but whole on every rank: nothing in the class shards
    merged = re.findall(r"QKVParallelLinear\((.*?)\n\s*\)", text, re.S)
    assert all("disable_tp=True" in args for args in merged), merged
    assert "self.o_proj = ReplicatedLinear(" in text


def test_linears_no_plan_shards_are_said_to_be_replicated():
    """Linears no plan can shard are held whole on each rank, a slow path under TP that
    the report names with the reason: CodeGen's attention reshapes its packed q|v|k by
    a count of groups the proof's ranks cannot split (Qwen3's are all sharded; OPT,
    without a TP plan, by its dataflow; Falcon's own `nn.Linear` subclass is proven a
    linear: test_linear_subclass.py; BLOOM's weight reads sit on a branch its config
    decides: test_config_branches.py)."""
    from codemods.apply import generate

    plan, text = generate("modeling_codegen.py")
    lines = [u.describe() for u in plan.unfused if u.what == "tensor parallel"]
    assert any(
        line.startswith(
            "Unfused: tensor parallel (CodeGenAttention): replicated: sharded over 2 "
            "ranks it fails (RuntimeError: "
        )
        for line in lines
    ), lines
    # and its heads are not divided over ranks its linears do not shard
    assert "get_tensor_model_parallel_world_size" not in text
    for source in ("modeling_qwen3.py", "modeling_opt.py"):
        plan, _ = generate(source)
        assert [u for u in plan.unfused if u.what == "tensor parallel"] == [], source


def test_a_non_attention_mixer_is_out_of_scope_in_one_line(tmp_path):
    result = run_cli("codemods.apply", "modeling_rwkv.py", "--out", str(tmp_path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "error: out of scope: no class of modeling_rwkv.py calls transformers' "
        "attention interface or computes attention itself"
    ), lines[0]
    assert not list(tmp_path.iterdir())


def test_an_attention_that_computes_its_own_mask_is_refused(tmp_path):
    """DeepSeek-V3.2-style sparse attention rebinds the mask from an indexer's top-k
    before its attention call; vLLM's Attention takes no mask, so the class refuses
    (a tiny probe whose top-k covers every token would not see the difference)."""
    path = edited_modeling_file(
        tmp_path,
        "modeling_llama.py",
        "        attention_interface: Callable = ",
        "        attention_mask = attention_mask.masked_fill(query_states.sum(-1, keepdim=True) > 1e9, 0.0)\n"
        "        attention_interface: Callable = ",
    )
    result = apply_faithful(path, tmp_path / "out")
    assert result.returncode == 2, result.stderr
    assert (
        "LlamaAttention.forward computes the mask it attends through (`attention_mask = ...`"
        in result.stderr
    )
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "out" / "llama.py").exists()


def test_qkv_rebuilt_after_projection_is_merged_in_a_copied_attention(tmp_path):
    """Phi concatenates its query again after partial rotary, so `query_states` is
    assigned twice: the copied attention still merges q/k/v, the projections read off
    the names' first assignments and the rebuild left to the dataflow proof."""
    result = run_cli(
        "codemods.apply", "modeling_phi.py", "--out", str(tmp_path / "out")
    )
    assert result.returncode == 0, result.stderr
    assert (
        "Fused: q_proj + k_proj + v_proj (PhiAttention) -> qkv_proj (QKVParallelLinear)"
        in result.stderr
    )
    text = (tmp_path / "out" / "phi.py").read_text()
    assert "self.qkv_proj = QKVParallelLinear(" in text
    assert "query_states = torch.cat((query_rot, query_pass), dim=-1)" in text


def test_a_rebuilt_query_that_reads_the_value_is_not_merged(tmp_path):
    """The same rebuild mixing the value into the query: the attention call's query no
    longer comes from q_proj alone, and the dataflow proof refuses the merge."""
    path = edited_modeling_file(
        tmp_path,
        "modeling_phi.py",
        "query_states = torch.cat((query_rot, query_pass), dim=-1)",
        "query_states = torch.cat((query_rot, query_pass), dim=-1) * value_states.mean()",
    )
    result = run_cli(
        "codemods.apply",
        str(path),
        "--trust-remote-code",
        "--out",
        str(tmp_path / "out"),
    )
    assert result.returncode == 0, result.stderr
    assert (
        "Refused: q/k/v projections (PhiAttention): the attention call's query comes "
        "from ['q_proj', 'v_proj'], not q_proj" in result.stderr
    )
    assert "QKVParallelLinear(" not in (tmp_path / "out" / "phi.py").read_text()
