"""The engine runs behind test_user_features, all in one process (TP=1 engines run in
process, so each start is seconds): `python tests/user_cases.py SPEC.json` prints one
`CASE {json}` line per case of SPEC (a list of {"case": name, ...}).

Each case builds its tiny checkpoint (features on, as `verify` builds it), the
transformers model that computes what vLLM should compute from it, and one engine on
the generated class (or on a copy of it, for the able-to-fail runs)."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

import user_checkpoints as uc  # noqa: E402
from codemods import engine, reference, registration, tiny  # noqa: E402
from codemods.reduced_precision import tie_gaps  # noqa: E402
from codemods.verify import MAX_TOKENS, compare, prompts_for  # noqa: E402

LAYER0 = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def onednn_int8_on_every_cpu() -> None:
    """The int8 linears take oneDNN's path on every CPU. On one with AMX tiles vLLM 0.32
    picks its SGL kernel from the weight's dtype (int8), but that kernel takes bf16 or
    fp16 activations only, and these cases run in fp32: every W8A8 engine then fails
    (`int8_scaled_mm_with_quant: expect A to be bfloat16 or half`), vLLM's bug, not the
    generated file's. oneDNN is the path a CPU without AMX takes anyway."""
    from vllm.model_executor.kernels.linear.scaled_mm import cpu

    sgl = cpu.check_cpu_sgl_kernel
    cpu.check_cpu_sgl_kernel = lambda n, k, dtype: dtype != torch.int8 and sgl(
        n, k, dtype
    )


def build(arch: str, out: Path):
    """(transformers model loaded back from `out`, prompts) for a tiny `arch`."""
    causal = getattr(transformers, arch)
    config = causal.config_class(**tiny.working_values(causal))
    model = tiny.build_checkpoint(causal, config, out)
    return model, prompts_for(model.config.vocab_size)


def architecture(spec: dict, workdir: Path) -> str:
    """The registered name of the generated class, or of the copy `spec` names."""
    if not spec.get("generated_copy"):
        return f"Generated{spec['arch']}"
    plugin = workdir / "plugin"
    plugin.mkdir(exist_ok=True)
    arch, _ = registration.register_external(
        Path(spec["generated_copy"]), spec["arch"], plugin
    )
    return arch


def linears(spec: dict) -> tuple[str, ...]:
    """The names of layer 0's linears the case reports (a file whose linears keep the
    source's names lists them)."""
    return tuple(spec.get("linears", LAYER0))


def generate(llm, prompts, lora=None, prompt_logprobs=True):
    """`engine.greedy` as an EngineResult. With a LoRA adapter only the generated
    positions: vLLM's CPU LoRA logits path cannot return prompt logprobs (an einsum
    shape error in punica_cpu)."""
    tokens, logprobs = engine.greedy(llm, prompts, MAX_TOKENS, prompt_logprobs, lora)
    return engine.EngineResult("", tokens, logprobs)


def layer0_modules(model, linears=LAYER0) -> dict:
    """{name: (wrapper class, quant scheme, kernel)} of layer 0's linears."""
    out = {}
    for name, module in model.named_modules():
        if ".layers.0." in name and name.rsplit(".", 1)[-1] in linears:
            scheme = getattr(module, "scheme", None)
            kernel = getattr(scheme, "kernel", None)
            out[name.split(".layers.0.", 1)[1]] = [
                type(module).__name__,
                type(scheme).__name__ if scheme else None,
                type(kernel).__name__ if kernel else None,
            ]
    return out


def quantized(spec: dict, tmp: Path) -> dict:
    model, prompts = build(spec["arch"], tmp / "base")
    targets = [[f"re:.*\\.{p}$" for p in spec["quantize"]]]
    dequantized = uc.quantize_w8a8(
        tmp / "base", tmp / "w8a8", targets, spec.get("ignore", []), uc.WEIGHT_LEVELS
    )
    # the engine first: the cases that must fail fail at its start
    llm = engine.start_llm(str(tmp / "w8a8"), architecture(spec, tmp))
    ran = generate(llm, prompts)
    ref = reference.greedy_with_logprobs(
        uc.w8a8_reference(model, dequantized), prompts, MAX_TOKENS
    )
    tensors = uc.load_file(tmp / "w8a8" / "model.safetensors")
    # layer 0's fused linears on one input, against the dequantized shards they hold
    layer = spec.get("layer", "model.layers.0")
    expected = {}
    x_by_width = {}
    for fused, shards in spec["layer0"].items():
        weight = torch.cat([dequantized[f"{layer}.{s}.weight"] for s in shards], dim=0)
        biases = [tensors.get(f"{layer}.{s}.bias") for s in shards]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None
        x = x_by_width.setdefault(
            weight.shape[1],
            torch.randn(5, weight.shape[1], generator=torch.Generator().manual_seed(0)),
        )
        want = uc.fake_quantize_per_token(x) @ weight.T
        expected[fused] = (x, want + bias if bias is not None else want)

    def layer_errors(vllm_model) -> dict:
        errors = {}
        for fused, (x, want) in expected.items():
            module = vllm_model.get_submodule(f"{layer}.{fused}")
            with torch.no_grad():
                got = module(x)
            got = got[0] if isinstance(got, tuple) else got
            errors[fused] = float((got - want).abs().max() / want.abs().max())
        return errors

    max_diff, tokens_equal = compare(prompts, ref, ran)
    return {
        "tie_gaps": tie_gaps(prompts, ref, ran),
        "impl": llm.apply_model(engine.model_class_name)[0],
        "layers": llm.apply_model(partial(layer0_modules, linears=linears(spec)))[0],
        "layer_rel_error": llm.apply_model(layer_errors)[0],
        "max_abs_logprob_diff": max_diff,
        "tokens_equal": tokens_equal,
    }


def lora(spec: dict, tmp: Path) -> dict:
    from vllm.lora.request import LoRARequest

    model, prompts = build(spec["arch"], tmp / "base")
    ref_base = reference.greedy_with_logprobs(model, prompts, MAX_TOKENS)
    adapter = Path(spec.get("adapter_dir") or tmp / "adapter")
    uc.make_lora_adapter(model, adapter, spec["targets"])
    ref_adapter = reference.greedy_with_logprobs(model, prompts, MAX_TOKENS)
    if spec.get("keep_checkpoint"):  # the server test serves the same files
        import shutil

        shutil.copytree(tmp / "base", spec["keep_checkpoint"])
    llm = engine.start_llm(
        str(tmp / "base"),
        architecture(spec, tmp),
        enable_lora=True,
        max_lora_rank=uc.LORA_RANK,
        max_loras=1,
    )
    base = generate(llm, prompts, prompt_logprobs=False)
    with_adapter = generate(
        llm, prompts, LoRARequest("adapter", 1, str(adapter)), prompt_logprobs=False
    )
    return {
        "impl": llm.apply_model(engine.model_class_name)[0],
        "layers": llm.apply_model(partial(layer0_modules, linears=linears(spec)))[0],
        "base": compare(prompts, ref_base, base, prompt_positions=False),
        "adapter": compare(prompts, ref_adapter, with_adapter, prompt_positions=False),
        "adapter_vs_base_model": compare(
            prompts, ref_base, with_adapter, prompt_positions=False
        ),
        "prompts": prompts,
        "base_tokens": base.tokens,
        "adapter_tokens": with_adapter.tokens,
    }


CASES = {"quantized": quantized, "lora": lora}


def main(spec_path: str) -> None:
    from vllm.distributed import cleanup_dist_env_and_memory

    onednn_int8_on_every_cpu()
    for spec in json.loads(Path(spec_path).read_text()):
        start = time.time()
        with tempfile.TemporaryDirectory(prefix=f"case-{spec['name']}-") as tmp:
            try:
                result = {"ok": True, **CASES[spec["case"]](spec, Path(tmp))}
            except Exception as exc:  # the expected failures: vLLM's own message
                lines = str(exc).strip().splitlines() or [""]
                result = {"ok": False, "error": f"{type(exc).__name__}: {lines[0]}"}
            finally:
                cleanup_dist_env_and_memory()
        result["seconds"] = round(time.time() - start, 1)
        print("CASE " + json.dumps({"name": spec["name"], **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
