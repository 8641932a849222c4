"""Generated models with what users put on top of them, in real vLLM: compressed-tensors
W8A8 int8 checkpoints and PEFT LoRA adapters, made by hand from tiny checkpoints
(tests/user_checkpoints.py). All engines run in one process (tests/user_cases.py);
each case asserts which model class and which vLLM layer classes ran."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.engine

QWEN3 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3 = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
# a faithful dense file: OPT's copied classes, sharded by the plan their dataflow gives
# (no TP plan in its config), under the source's names
OPT = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
OPT_LAYER0 = {name: [name] for name in [*(f"self_attn.{p}" for p in OPT[:4]), *OPT[4:]]}
OPT_LAYER = "model.decoder.layers.0"
# layer 0's fused linears and the checkpoint modules each holds
QWEN3_LAYER0 = {
    "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "self_attn.o_proj": ["self_attn.o_proj"],
    "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.down_proj": ["mlp.down_proj"],
}
PHI3_LAYER0 = {
    f"{part}.{p}": [f"{part}.{p}"]
    for part, projs in (("self_attn", PHI3[:2]), ("mlp", PHI3[2:]))
    for p in projs
}
# A W8A8 engine quantizes each linear's input per token; the reference does the same in
# fp32 transformers, but its inputs differ from the engine's by ~1e-6 (another attention
# and matmul order), and an element that close to a rounding boundary lands one int8
# level away, which later layers carry: 4e-2 is measured on the whole model. Each fused
# layer on one shared input is exact to fp32 rounding.
W8A8_LOGPROB_TOLERANCE = 0.1
# In a MoE model the router picks experts by rank: one int8 level moves a token's top-k
# where two experts' scores nearly tie, a jump no tolerance on smooth error covers
# (0.18 measured on a CPU without AMX, 9e-3 on one with it). The layers above still
# must be exact.
MOE_W8A8_LOGPROB_TOLERANCE = 0.5
LAYER_TOLERANCE = 1e-5
LORA_TOLERANCE = 1e-4


def without_qkv_mapping(tmp_path) -> str:
    """A copy of generated/qwen3.py whose packed_modules_mapping lacks qkv_proj."""
    text = (REPO / "generated" / "qwen3.py").read_text()
    entry = '        "qkv_proj": ["q_proj", "k_proj", "v_proj"],\n'
    assert text.count(entry) == 1
    path = tmp_path / "qwen3_without_qkv_mapping.py"
    path.write_text(text.replace(entry, ""))
    return str(path)


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("user-features")
    broken = without_qkv_mapping(tmp)
    specs = [
        dict(name="w8a8-dense", case="quantized", arch="Qwen3ForCausalLM",
             quantize=QWEN3, layer0=QWEN3_LAYER0),
        dict(name="w8a8-packed", case="quantized", arch="Phi3ForCausalLM",
             quantize=PHI3, layer0=PHI3_LAYER0),
        dict(name="w8a8-moe-attention", case="quantized", arch="Qwen3MoeForCausalLM",
             quantize=QWEN3[:4], layer0={k: v for k, v in QWEN3_LAYER0.items()
                                         if k.startswith("self_attn")}),
        dict(name="w8a8-moe-experts", case="quantized", arch="Qwen3MoeForCausalLM",
             quantize=QWEN3, layer0={}),
        dict(name="w8a8-q-without-k", case="quantized", arch="Qwen3ForCausalLM",
             quantize=QWEN3, ignore=["re:.*\\.k_proj$"], layer0={}),
        dict(name="w8a8-no-qkv-mapping", case="quantized", arch="Qwen3ForCausalLM",
             quantize=QWEN3, layer0=QWEN3_LAYER0, generated_copy=broken),
        dict(name="lora-dense", case="lora", arch="Qwen3ForCausalLM", targets=QWEN3,
             keep_checkpoint=str(tmp / "served"), adapter_dir=str(tmp / "adapter")),
        dict(name="lora-packed", case="lora", arch="Phi3ForCausalLM", targets=PHI3),
        dict(name="lora-no-qkv-mapping", case="lora", arch="Qwen3ForCausalLM",
             targets=QWEN3, generated_copy=broken),
        # faithful files: OPT (dense), PhiMoE (its block, router and layer copied, the
        # experts routed externally)
        dict(name="w8a8-faithful-dense", case="quantized", arch="OPTForCausalLM",
             quantize=OPT, layer0=OPT_LAYER0, layer=OPT_LAYER, linears=OPT),
        dict(name="lora-faithful-dense", case="lora", arch="OPTForCausalLM",
             targets=OPT, linears=OPT),
        dict(name="w8a8-faithful-moe", case="quantized", arch="PhimoeForCausalLM",
             quantize=QWEN3[:4], layer0={k: v for k, v in QWEN3_LAYER0.items()
                                         if k.startswith("self_attn")}),
        dict(name="lora-faithful-moe", case="lora", arch="PhimoeForCausalLM",
             targets=QWEN3[:4]),
    ]  # fmt: skip
    spec_file = tmp / "spec.json"
    spec_file.write_text(json.dumps(specs))
    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "user_cases.py"), str(spec_file)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    out = {
        (row := json.loads(line[len("CASE ") :]))["name"]: row
        for line in run.stdout.splitlines()
        if line.startswith("CASE ")
    }
    assert len(out) == len(specs), run.stderr[-4000:]
    out["_dirs"] = {"checkpoint": tmp / "served", "adapter": tmp / "adapter"}
    return out


def assert_w8a8_matches(
    row, layers: dict[str, str], module: str, tolerance=W8A8_LOGPROB_TOLERANCE
):
    assert row["ok"], row.get("error")
    assert row["impl"] == f"generated.{module}", row["impl"]
    for name, wrapper in layers.items():
        assert row["layers"][name] == [
            wrapper,
            "CompressedTensorsW8A8Int8",
            "CPUInt8ScaledMMLinearKernel",
        ], (name, row["layers"][name])
    for name, error in row["layer_rel_error"].items():
        assert error <= LAYER_TOLERANCE, (name, error)
    # greedy tokens equal, or split only at a near tie of the reference (int8 rounds
    # per CPU: AMD's VNNI and Intel's AMX kernels break a tie differently)
    assert row["tokens_equal"] or max(row["tie_gaps"]) <= tolerance, row["tie_gaps"]
    assert row["max_abs_logprob_diff"] <= tolerance


def test_a_w8a8_checkpoint_with_per_projection_targets_reaches_the_fused_layers(cases):
    # targets name q_proj, k_proj, ...: vLLM finds qkv_proj's scheme only through the
    # generated packed_modules_mapping
    assert_w8a8_matches(
        cases["w8a8-dense"],
        {
            "self_attn.qkv_proj": "QKVParallelLinear",
            "self_attn.o_proj": "RowParallelLinear",
            "mlp.gate_up_proj": "MergedColumnParallelLinear",
            "mlp.down_proj": "RowParallelLinear",
        },
        "qwen3:Qwen3ForCausalLM",
    )
    assert set(cases["w8a8-dense"]["layer_rel_error"]) == set(QWEN3_LAYER0)


def test_a_w8a8_checkpoint_of_a_packed_checkpoint_model(cases):
    assert_w8a8_matches(
        cases["w8a8-packed"],
        {
            "self_attn.qkv_proj": "QKVParallelLinear",
            "mlp.gate_up_proj": "MergedColumnParallelLinear",
        },
        "phi3:Phi3ForCausalLM",
    )
    assert set(cases["w8a8-packed"]["layer_rel_error"]) == set(PHI3_LAYER0)


def test_a_moe_model_runs_quantized_attention_and_vllm_says_why_not_int8_experts(cases):
    assert_w8a8_matches(
        cases["w8a8-moe-attention"],
        {"self_attn.qkv_proj": "QKVParallelLinear"},
        "qwen3_moe:Qwen3MoeForCausalLM",
        MOE_W8A8_LOGPROB_TOLERANCE,
    )
    # vLLM's CPU build has no int8 fused-MoE kernel for x86 without AMX (its CPU int8
    # experts run on ARM, POWER and with ZenDNN), and with AMX one for bf16 only; its
    # own message, from its own MoE layer
    experts = cases["w8a8-moe-experts"]
    assert not experts["ok"]
    assert any(
        message in experts["error"]
        for message in (
            "No Int8 MoE backend supports the deployment configuration",
            "\"fused_experts_kernel_impl\" not implemented for 'Float'",
        )
    ), experts["error"]


def test_quantizing_q_but_not_k_is_vllms_clear_error(cases):
    row = cases["w8a8-q-without-k"]
    assert not row["ok"]
    assert "Found different quantization schemes for the shards of" in row["error"]
    assert "qkv_proj" in row["error"]


def test_without_qkv_proj_in_the_mapping_the_quantized_checkpoint_does_not_load(cases):
    """Able-to-fail: the dense case, on a copy whose mapping lacks qkv_proj."""
    row = cases["w8a8-no-qkv-mapping"]
    assert not row["ok"], "a half-known mapping loaded a quantized checkpoint"
    # vLLM's loader, at the merged q/k/v layer it no longer quantizes (its int8
    # weight and scales have nowhere to go), not a failure of the harness
    assert "'QKVParallelLinear' object has no attribute" in row["error"], row["error"]


def assert_lora_matches(row, layers: dict[str, str], module: str):
    assert row["ok"], row.get("error")
    assert row["impl"] == f"generated.{module}", row["impl"]
    for name, wrapper in layers.items():
        assert row["layers"][name][0] == wrapper, (name, row["layers"][name])
    max_diff, tokens_equal = row["base"]
    assert tokens_equal and max_diff <= LORA_TOLERANCE, row["base"]
    max_diff, tokens_equal = row["adapter"]
    assert tokens_equal and max_diff <= LORA_TOLERANCE, row["adapter"]
    # and the adapter did something: not the base model's numbers
    assert row["adapter_vs_base_model"][0] > 100 * LORA_TOLERANCE


def test_a_lora_adapter_on_every_projection_of_a_dense_model(cases):
    assert_lora_matches(
        cases["lora-dense"],
        {
            "self_attn.qkv_proj": "MergedQKVParallelLinearWithLoRA",
            "self_attn.o_proj": "RowParallelLinearWithLoRA",
            "mlp.gate_up_proj": "MergedColumnParallelLinearWithLoRA",
            "mlp.down_proj": "RowParallelLinearWithLoRA",
        },
        "qwen3:Qwen3ForCausalLM",
    )


def test_a_lora_adapter_on_a_packed_checkpoint_model(cases):
    # Phi-3's adapter has one A/B pair per packed module (PEFT targets qkv_proj
    # itself), so vLLM wraps them as single-slice LoRA layers
    assert_lora_matches(
        cases["lora-packed"],
        {
            "self_attn.qkv_proj": "QKVParallelLinearWithLoRA",
            "self_attn.o_proj": "RowParallelLinearWithLoRA",
            "mlp.gate_up_proj": "ColumnParallelLinearWithLoRA",
            "mlp.down_proj": "RowParallelLinearWithLoRA",
        },
        "phi3:Phi3ForCausalLM",
    )


def test_a_faithful_dense_file_serves_w8a8_and_lora_on_its_own_linears(cases):
    """OPT: every linear of layer 0 quantized (its copied attention's and decoder
    layer's, sharded by the derived plan), then an adapter on each."""
    assert_w8a8_matches(
        cases["w8a8-faithful-dense"],
        {name: ("RowParallelLinear" if name.endswith(("out_proj", "fc2")) else "ColumnParallelLinear")
         for name in OPT_LAYER0},
        "opt:OPTForCausalLM",
    )  # fmt: skip
    assert set(cases["w8a8-faithful-dense"]["layer_rel_error"]) == set(OPT_LAYER0)
    assert_lora_matches(
        cases["lora-faithful-dense"],
        {name: ("RowParallelLinearWithLoRA" if name.endswith(("out_proj", "fc2")) else "ColumnParallelLinearWithLoRA")
         for name in OPT_LAYER0},
        "opt:OPTForCausalLM",
    )  # fmt: skip


def test_a_faithful_moe_file_serves_w8a8_on_its_attention(cases):
    """PhiMoE: its block, router and decoder layer as the source writes them, the
    experts vLLM's fused layer; the attention's merged q/k/v quantized."""
    assert_w8a8_matches(
        cases["w8a8-faithful-moe"],
        {"self_attn.qkv_proj": "QKVParallelLinear", "self_attn.o_proj": "RowParallelLinear"},
        "phimoe:PhimoeForCausalLM",
        MOE_W8A8_LOGPROB_TOLERANCE,
    )  # fmt: skip


def test_lora_on_a_moe_model_stops_at_vllms_cpu_moe_kernel(cases):
    """With LoRA on, vLLM 0.32 runs a MoE layer's experts through its Triton kernel,
    which the CPU build does not have: its own Qwen3-MoE class stops the same way on
    this build (measured), so no MoE file, faithful or native, serves an adapter here.
    """
    row = cases["lora-faithful-moe"]
    assert not row["ok"]
    assert "triton.language" in row["error"], row["error"]


def test_without_qkv_proj_in_the_mapping_the_adapter_is_not_served(cases):
    """Able-to-fail: the dense adapter on a copy whose mapping lacks qkv_proj."""
    row = cases["lora-no-qkv-mapping"]
    matched = row["ok"] and row["adapter"][1] and row["adapter"][0] <= LORA_TOLERANCE
    assert not matched, "the adapter matched without the qkv_proj mapping"
    # vLLM's adapter check: q/k/v targets, which only the mapping ties to qkv_proj
    assert "expected target modules in" in row["error"], row["error"]
    assert "self_attn.q_proj" in row["error"].split("but received")[1], row["error"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command() -> list[str]:
    """The console script `pip install` puts next to this Python."""
    from pathlib import Path

    script = Path(sys.executable).parent / "vllm-fusion-serve"
    assert script.exists(), f"{script}: not installed (pip install -e .)"
    return [str(script)]


def test_the_openai_server_serves_the_generated_model_and_an_adapter(cases, tmp_path):
    """`vllm-fusion-serve` on 127.0.0.1: /health, then /v1/completions with token ids
    through the openai client, for the base model and the LoRA adapter, against the
    offline engine's tokens on the same checkpoint and adapter."""
    import os
    import signal
    import time
    import urllib.request

    import openai

    offline = cases["lora-dense"]
    assert offline["ok"], offline.get("error")
    # the adapter changes the tokens: serving the base model for it would be caught
    assert offline["adapter_tokens"] != offline["base_tokens"]
    ckpt, adapter = cases["_dirs"]["checkpoint"], cases["_dirs"]["adapter"]
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        serve_command()
        + [str(ckpt), "--host", "127.0.0.1", "--port", str(port)]
        + ["--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "256"]
        + ["--enforce-eager", "--seed", "0", "--enable-lora", "--max-lora-rank", "8"]
        + ["--lora-modules", f"adapter={adapter}"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the engine process it starts goes with it
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    try:
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/health", timeout=5
                ):
                    break
            except OSError:
                assert time.time() < deadline, "no /health within 600 s"
                time.sleep(1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-")
        for model, want in ((str(ckpt), "base_tokens"), ("adapter", "adapter_tokens")):
            response = client.completions.create(
                model=model,
                prompt=offline["prompts"],
                max_tokens=len(offline[want][0]),
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            got = [c.token_ids for c in sorted(response.choices, key=lambda c: c.index)]
            assert got == offline[want], model
    finally:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
            log.close()
    text = (tmp_path / "server.log").read_text()
    # the class that ran: the generated one, named by vLLM itself
    assert "Resolved architecture: GeneratedQwen3ForCausalLM" in text, text[-3000:]
    assert f"with GeneratedQwen3ForCausalLM (generated/qwen3.py)" in text
