"""The q/k/v merge reads a copied attention as the generated file runs it: BioGPT's
forward also serves cross-attention (a second `key_states = <cached keys>` and
`current_states = key_value_states if is_cross_attention else hidden_states`), which
the copy folds away (vLLM never passes `key_value_states` or a cache). Read folded, its
three projections of one input are vLLM's QKVParallelLinear, as the backend fuses
them; its widths (`embed_dim`) count heads through the head size. Engine-free; the
TP=1/TP=2/PP=2 runs are the coverage row's (`python -m codemods.verify biogpt`)."""

from __future__ import annotations

import importlib
import textwrap

import libcst as cst
import pytest

from codemods.apply import generate
from fusion_patterns.base import PatternRefused, code
from fusion_patterns.qkv import proof

# the module (the package exports its `match` function under the same name)
qkv_match = importlib.import_module("fusion_patterns.qkv.match")


@pytest.fixture(scope="module")
def biogpt():
    return generate("modeling_biogpt.py")


def _folded_spec():
    from dataclasses import replace

    from codemods.copying.inference import inference_folded
    from codemods.source import load

    info = load("modeling_biogpt.py").classes["BioGptAttention"]
    folded = replace(info, forward=inference_folded(info.forward))
    return info, qkv_match.match(folded, {}, lenient=True)


def test_the_source_as_written_is_refused_and_as_copied_is_matched():
    info, spec = _folded_spec()
    refused = qkv_match.match(info, {}, lenient=True)
    assert refused.reason == "key_states is assigned twice"
    assert spec.projections == ("q_proj", "k_proj", "v_proj")
    # `nn.Linear(embed_dim, embed_dim)`: heads are the stored width over the head size
    assert code(spec.num_heads) == "self.embed_dim // self.head_dim"
    assert code(spec.num_kv_heads) == "self.embed_dim // self.head_dim"


def _attention():
    from transformers import BioGptConfig
    from transformers.models.biogpt.modeling_biogpt import BioGptAttention

    config = BioGptConfig(hidden_size=64, num_attention_heads=4, vocab_size=32)
    return BioGptAttention(64, 4, config=config, layer_idx=0, is_decoder=True)


def test_the_dataflow_is_traced_on_the_path_the_file_runs():
    _, spec = _folded_spec()
    attention = _attention()
    # traced with key_value_states a tensor: the cross-attention path, k/v elsewhere
    with pytest.raises(PatternRefused, match="consume different graph nodes"):
        proof.prove_dataflow(spec, attention)
    proof.prove_dataflow(spec, attention, {"key_value_states": None})
    proof.prove_merged_gemm(spec, attention, attention.config)


def test_an_alias_is_read_through_only_when_it_is_a_plain_name():
    forward = cst.parse_module(textwrap.dedent("""
            def forward(self, hidden_states):
                current_states = hidden_states
                scaled = hidden_states * 2
                return current_states, scaled
            """)).body[0]
    assert qkv_match._aliased(forward, "current_states") == "hidden_states"
    assert qkv_match._aliased(forward, "scaled") == "scaled"


def test_keys_of_another_tensor_on_the_copied_path_are_refused(tmp_path):
    from conftest import edited_modeling_file

    old = "current_states = key_value_states if is_cross_attention else hidden_states"
    new = (
        "current_states = key_value_states if is_cross_attention else hidden_states * 2"
    )
    path = edited_modeling_file(tmp_path, "modeling_biogpt.py", old, new)
    plan, text = generate(str(path), trust_remote_code=True)
    (refused,) = [r for r in plan.refusals if r.source_class == "BioGptAttention"]
    assert refused.reason == "key_states is assigned twice"  # the fold does not help
    assert "QKVParallelLinear" not in text


def test_biogpt_fuses_its_projections_and_loads_them_stacked(biogpt):
    plan, text = biogpt
    assert (
        "#   Fused: q_proj + k_proj + v_proj (BioGptAttention) -> qkv_proj "
        "(QKVParallelLinear)" in text
    )
    assert not [r for r in plan.refusals if r.source_class == "BioGptAttention"]
    assert '".self_attn.k_proj.": (".self_attn.qkv_proj.", "k")' in text
    forward = text[text.index("class BioGptAttention") :]
    forward = forward[forward.index("def forward") : forward.index("\nclass ")]
    assert "self.k_proj" not in forward and "self.v_proj" not in forward
    assert "key_states = k\n" in forward
