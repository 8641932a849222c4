"""The scope line, engine-free: what `apply` says is out of scope, and why, before it
builds anything; and a layer list found among the lists a tiny model holds."""

from __future__ import annotations

import pytest

from conftest import run_cli


@pytest.mark.parametrize(
    "name, model_type",
    [("modeling_roberta.py", "roberta"), ("modeling_xlm.py", "xlm")],
)
def test_a_masked_lm_encoder_run_causally_is_out_of_scope(name, model_type, tmp_path):
    """The BERT family registers a causal-LM head over its bidirectional encoder:
    transformers also maps the model type to a masked-LM head, and `apply` says so in
    one line, writing nothing (XLM's tiny model, four parallel lists of layers, is never
    built)."""
    result = run_cli("codemods.apply", name, "--out", str(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: out of scope: encoder (bidirectional: ")
    assert f"maps {model_type} to a masked-LM head" in lines[0]
    assert "pooling models" in lines[0]
    assert not list(tmp_path.iterdir())


def test_a_causal_lm_only_over_a_multimodal_config_is_not_a_text_lm(tmp_path):
    result = run_cli("codemods.apply", "modeling_fuyu.py", "--out", str(tmp_path))
    assert result.returncode == 2
    assert (
        "error: out of scope: not a text LM: transformers/models/fuyu/modeling_fuyu.py"
        " builds its causal LM (FuyuForCausalLM) only over a multimodal config"
        in result.stderr
    )


@pytest.mark.parametrize(
    "name", ["modeling_musicgen.py", "modeling_musicgen_melody.py"]
)
def test_a_causal_lm_generating_audio_is_not_a_text_lm(name, tmp_path):
    """MusicGen's decoder predicts a token per audio codebook at each step: transformers
    says it generates audio; said before any tiny model is built (its tiny build failed
    on a reshape before), writing nothing."""
    result = run_cli("codemods.apply", name, "--out", str(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: out of scope: not a text LM: Musicgen")
    assert lines[0].endswith(
        "ForCausalLM generates audio (transformers' output_modalities), not text"
    )
    assert not list(tmp_path.iterdir())


def test_moshis_text_decoder_is_not_taken_for_its_audio_model(tmp_path):
    # MoshiForCausalLM: one text head over the temporal transformer (its config counts
    # audio codebooks, which this decoder does not predict)
    moshi = run_cli("codemods.apply", "modeling_moshi.py", "--out", str(tmp_path))
    assert "out of scope" not in moshi.stderr, moshi.stderr


def test_a_decoder_is_in_scope_whatever_its_class_is_called():
    """The causal-LM mapping names the class (Reformer's `ReformerModelWithLMHead`):
    found by it, the encoder rule then decides, not the class's suffix."""
    from codemods import loading, roles
    from codemods.source import load

    src = load("modeling_reformer.py")
    cls = roles.causal_class(loading.load_module(src), src.classes, src)
    assert cls.__name__ == "ReformerModelWithLMHead"


def test_per_head_lists_inside_a_layer_are_not_the_layer_list():
    """StableLM's per-head q/k norms are a ModuleList as long as the tiny config's
    layer list: the list inside a layer is not taken for it, and the file generates
    with the per-head norms copied."""
    from codemods.apply import generate

    plan, text = generate("modeling_stablelm.py")
    assert "class StableLmLayerNormPerHead(nn.Module):" in text
    assert "self.start_layer, self.end_layer, self.layers = make_layers(" in text
    assert any(
        r.describe().startswith("Fused: gate_proj + up_proj (StableLmMLP)")
        for r in plan.records
    )


def test_a_draft_model_that_needs_another_models_states_is_not_a_standalone_lm(
    tmp_path,
):
    """Gemma 4's assistant raises unless handed the main model's embeddings and KV
    states: no token-ids-only run exists to verify, and `apply` says so in one line."""
    result = run_cli(
        "codemods.apply", "modeling_gemma4_assistant.py", "--out", str(tmp_path)
    )
    assert result.returncode == 2
    assert (
        "error: out of scope: not a standalone LM: Gemma4AssistantForCausalLM.forward "
        "raises without `inputs_embeds` and `shared_kv_states`" in result.stderr
    )
    assert not list(tmp_path.iterdir())


def test_an_either_ids_or_embeddings_check_is_not_a_required_input():
    """`if (input_ids is None) ^ (inputs_embeds is not None): raise` and `if input_ids
    is None and inputs_embeds is None: raise` ask for one of the two, not for both."""
    import libcst as cst

    from codemods.probe import _required_inputs
    from codemods.source import class_infos

    def required(check: str) -> list[str]:
        module = cst.parse_module(
            "class M:\n"
            "    def forward(self, input_ids=None, inputs_embeds=None, extra=None):\n"
            f"        if {check}:\n"
            "            raise ValueError('no')\n"
            "        return input_ids\n"
        )
        return _required_inputs(class_infos(module)["M"])

    assert required("(input_ids is None) ^ (inputs_embeds is not None)") == []
    assert required("input_ids is None and inputs_embeds is None") == []
    assert required("inputs_embeds is None or extra is None") == [
        "inputs_embeds",
        "extra",
    ]


def test_a_file_in_which_nothing_attends_is_out_of_scope_before_any_build(tmp_path):
    """RWKV's time mixing is a recurrence no pattern maps (Mamba's selective scans are
    mapped: those files are generated): said from the source, before any tiny model is
    built."""
    result = run_cli("codemods.apply", "modeling_rwkv.py", "--out", str(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        "error: out of scope: no class of modeling_rwkv.py calls transformers' "
        "attention interface"
    )
    assert not list(tmp_path.iterdir())


def test_a_convolution_inside_attention_is_a_state_cache_not_a_selection(tmp_path):
    """ZAYA mixes its q/k with a causal convolution over the sequence: state carried
    across decode steps that only vLLM's own state caches hold, not a sparse top-k."""
    result = run_cli("codemods.apply", "modeling_zaya.py", "--out", str(tmp_path))
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.startswith("error: out of scope: ZayaCCAProjection keeps state")
    assert "a convolution over the sequence (nn.Conv1d)" in line
    assert "sparse selection" not in line
    assert not list(tmp_path.iterdir())


def test_a_two_line_error_is_reported_on_one_line():
    from codemods.probe import one_line

    exc = ValueError(
        "Class validation error for 'validate_architecture':\n    top-1 only\n"
    )
    assert (
        one_line(exc)
        == "Class validation error for 'validate_architecture': top-1 only"
    )


class _Shifted(__import__("torch").nn.Module):
    """Mixes tokens in its own forward (a token shift, RWKV's way): no submodule
    says so."""

    def __init__(self):
        super().__init__()
        self.proj = __import__("torch").nn.Linear(8, 8)

    def forward(self, hidden_states):
        import torch

        shifted = torch.cat(
            [torch.zeros_like(hidden_states[:, :1]), hidden_states[:, :-1]], dim=1
        )
        return self.proj(hidden_states + shifted)


def test_a_layer_without_attention_is_in_scope_only_if_it_mixes_no_tokens():
    """Nemotron-H's MLP and MoE blocks neither attend nor keep state: rerun with the
    first token changed, every later token's output is the same. A layer mixing tokens
    in its own forward is not."""
    import torch

    from codemods.roles import _token_wise

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU())
    shifted = _Shifted()
    x = torch.randn(1, 5, 8)
    with torch.no_grad():
        assert _token_wise(mlp, ((x,), {}, mlp(x)))
        assert not _token_wise(shifted, ((x,), {}, shifted(x)))
        # handed by keyword, as the base model's loop may hand it
        assert not _token_wise(
            shifted, ((), {"hidden_states": x}, shifted(hidden_states=x))
        )
    assert not _token_wise(mlp, None)  # never called: not shown token-wise


def test_an_attention_vllm_cannot_take_is_out_of_scope_only_where_vllm_has_no_class(
    tmp_path,
):
    """Doge attends through a mask it computes from the data, DeepSeek-V3.2 through a
    sparse top-k index: neither fits vLLM's Attention. vLLM has no class for Doge
    (out of scope, as for a mixer nothing in vLLM computes); it serves DeepSeek-V3.2
    with its own file, so that row stays refused and names it."""
    doge = run_cli("codemods.apply", "modeling_doge.py", "--out", str(tmp_path))
    assert doge.returncode == 2, doge.stderr
    line = doge.stderr.strip()
    assert line.startswith(
        "error: out of scope: DogeAttention.forward computes the mask"
    )
    assert line.endswith("vLLM has no class for DogeForCausalLM either")
    v32 = run_cli("codemods.apply", "modeling_deepseek_v32.py", "--out", str(tmp_path))
    assert v32.returncode == 2, v32.stderr
    line = v32.stderr.strip()
    assert line.startswith("error: cannot generate: model.layers.0.self_attn hands")
    assert "`indices=` (a tensor)" in line
    assert "vLLM serves DeepseekV32ForCausalLM with its own " in line
    assert not list(tmp_path.iterdir())


def test_an_encoder_causal_only_by_its_config_flag_is_out_of_scope(tmp_path):
    """BERT-Generation's decoder is its encoder's stack, causal only when the config
    says `is_decoder` (transformers maps bert-generation to no masked-LM head, so the
    mapping rule missed it and the row read as a refusal on its layer owner)."""
    result = run_cli(
        "codemods.apply", "modeling_bert_generation.py", "--out", str(tmp_path)
    )
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert line.startswith("error: out of scope: encoder (bidirectional unless ")
    assert "BertGenerationDecoder.__init__ checks the flag" in line
    assert not list(tmp_path.iterdir())
