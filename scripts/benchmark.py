"""Benchmark every generated model in real vLLM against vLLM's native class and the
Transformers backend, and time the toolkit itself.

    python scripts/benchmark.py                      # the default set, 3 repeats
    python scripts/benchmark.py --models qwen3,llama --repeats 5   # replaces their rows
    python scripts/benchmark.py --models all         # every generated model (hours)
    python scripts/benchmark.py --resume             # finish an interrupted run
    python scripts/benchmark.py --quick              # tiny sizes, 1 repeat: a smoke test
    python scripts/benchmark.py --update-readme      # also rewrite README's benchmark section
    python scripts/benchmark.py --render-only        # tables, plot, README from results.json

Per generated model (found from the headers in generated/, nothing per model here): one
random-weight checkpoint built from the model's own transformers config class (sizes only),
served by each implementation in turn: the generated class (`Generated<Arch>`), vLLM's
native class (when vLLM has one) and the Transformers backend (`model_impl="transformers"`).
Every run is its own process, runs alternate between implementations (A B C A B C ...), and
every run asserts which class actually ran. Measured: throughput (many requests at once),
time to first token and inter-token latency (one request at a time), `LLM(...)` start-up
with model construction and weight loading; then the toolkit's own speed (`codemods.apply`,
`codemods.check` cold and warm). Writes results.json, results.md and ratios.png to --out.

results.json is merged per model: a run replaces the rows of the models it ran and keeps
the others as they were measured (each with its date and the sha256 of the file it ran),
and is saved after every model, so `--resume` goes on where an interrupted run stopped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# codemods/ and generated/ importable even without `pip install -e .`
sys.path.insert(0, str(REPO))

from codemods.vllm_native import TRANSFORMERS_BACKEND  # noqa: E402

IMPLS = ("generated", "native", "transformers")
IMPL_LABELS = {
    "generated": "generated",
    "native": "vLLM native",
    "transformers": "Transformers backend",
}
# One model per family and layout, under 30 minutes on 2 cores at 3 repeats: native
# layouts (dense, per-layer-type sliding windows, MoE) and faithful files of each kind of
# copied part (learned positions, ALiBi, parallel blocks, shared experts, routed experts
# behind the source's router, flattened experts, latent attention, sinks).
DEFAULT_MODELS = (
    "qwen3",
    "llama",
    "gemma3",
    "qwen3_moe",
    "gpt2",
    "bloom",
    "falcon",
    "opt",
    "phi",
    "granitemoeshared",
    "phimoe",
    "dbrx",
    "deepseek_v2",
    "gpt_oss",
)
# settings a row measured under others cannot be compared with: a run on other ones
# starts the results afresh
COMPARABLE = ("preset", "dtype", "eager", "sizes", "throughput", "latency")
README_START, README_END = "<!-- benchmark:start -->", "<!-- benchmark:end -->"

# MoE models: 8 experts, top-2, one dense layer first (fields a class lacks are skipped)
MOE_SIZES = {
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
}
OPTIONAL_SIZES = {*MOE_SIZES, "moe_intermediate_size", "q_lora_rank"}

# Sizes: a scaled-down Qwen3-4B (head_dim 128, 4:1 GQA, intermediate ~3.8x hidden, the LM
# head ~10% of the weights). hidden = heads * head_dim, so configs without a head_dim field
# get the same shapes.
PRESETS = {
    "cpu": {
        "sizes": {
            "vocab_size": 4096,
            "hidden_size": 512,
            "intermediate_size": 1920,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 128,
            "moe_intermediate_size": 512,
            "q_lora_rank": 256,
            **MOE_SIZES,
        },
        # a fraction of a minute of CPU work per case
        "throughput": {"requests": 16, "prompt": 256, "output": 16},
        "latency": {"requests": 3, "prompt": 128, "output": 32},
        "max_model_len": 512,
    },
    "cuda": {
        "sizes": {
            "vocab_size": 32768,
            "hidden_size": 2048,
            "intermediate_size": 7680,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 128,
        },
        "throughput": {"requests": 256, "prompt": 1024, "output": 64},
        "latency": {"requests": 8, "prompt": 512, "output": 128},
        "max_model_len": 2048,
    },
    "quick": {
        "sizes": {
            "vocab_size": 1024,
            "hidden_size": 256,
            "intermediate_size": 960,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 64,
            "moe_intermediate_size": 256,
            "q_lora_rank": 128,
            **MOE_SIZES,
        },
        "throughput": {"requests": 8, "prompt": 64, "output": 8},
        "latency": {"requests": 2, "prompt": 32, "output": 8},
        "max_model_len": 256,
    },
}
# Other spellings of the size fields, for config classes that use their own names.
SIZE_ALIASES = {
    "vocab_size": ("n_vocab",),
    "hidden_size": ("n_embd", "d_model", "dim"),
    "intermediate_size": ("ffn_dim", "n_inner", "ffn_hidden_size", "intermediate_dim"),
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads"),
    "num_key_value_heads": ("num_kv_heads", "n_kv_heads", "multi_query_group_num"),
    "head_dim": ("head_size", "kv_channels"),
}
# (key, label, unit, higher is better)
METRICS = (
    ("throughput_tok_s", "throughput", "tok/s", True),
    ("ttft_ms", "TTFT", "ms", False),
    ("itl_ms", "ITL", "ms", False),
    ("startup_s", "LLM() start", "s", False),
    ("construct_s", "model construction", "s", False),
    ("weights_s", "weight loading + processing", "s", False),
)
LABELS = {metric: label for metric, label, *_ in METRICS}
README_METRICS = ("throughput_tok_s", "ttft_ms", "itl_ms", "startup_s")
TARGET_METRICS = ("throughput_tok_s", "ttft_ms", "itl_ms")
BUSY = (
    0.1  # share of the CPU other processes used during a run, above which it is flagged
)


# ---------------------------------------------------------------------------------------
# Child processes. Each job runs in a process forked from a server that has imported vLLM
# and nothing else: a fresh process per run (own registry, caches, patched HF classes)
# without paying `import vllm` (~10 s on 2 cores) for every one of ~50 runs.


def run_child(ctx, fn, job: dict, workdir: Path, name: str, timeout: float) -> dict:
    """Run `fn(job)` in a fresh process; its output goes to a log, its result to JSON."""
    result_path, log_path = workdir / f"{name}.json", workdir / f"{name}.log"
    proc = ctx.Process(target=_child_main, args=(fn, job, result_path, log_path))
    busy, start = _cpu_busy_s(), time.perf_counter()
    proc.start()
    proc.join(timeout)
    busy = None if busy is None else _cpu_busy_s() - busy
    wall = time.perf_counter() - start
    if proc.is_alive():
        proc.kill()
        proc.join()
        return {"error": f"timed out after {timeout:.0f} s", "log": _tail(log_path)}
    try:
        result = json.loads(result_path.read_text())
    except (OSError, json.JSONDecodeError):
        result = {"error": f"process died (exit code {proc.exitcode})"}
    if "error" in result:
        result["log"] = _tail(log_path)
    if busy is not None and "cpu_s" in result:
        # CPU time other processes used meanwhile, as a share of all cores: a busy
        # machine makes every number of this run suspect
        other = max(0.0, busy - result["cpu_s"]) / (wall * os.cpu_count())
        result["other_cpu_share"] = round(other, 3)
    return result


def _cpu_busy_s() -> float | None:
    """Seconds of CPU time all cores have spent busy since boot (Linux)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _child_main(fn, job: dict, result_path: Path, log_path: Path) -> None:
    with open(log_path, "w") as log:  # keep vLLM's logs out of the report
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        result = fn(job)
    except Exception as exc:
        traceback.print_exc()  # into the log, whose tail the report shows
        result = {
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc(),
        }
    times = os.times()
    result["cpu_s"] = times.user + times.system  # this process, all its threads
    result_path.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip engine teardown: the process is done and its numbers are written


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------
# Preparation: the models and the machine (one child), one checkpoint per model (a child
# each).


def read_generated_headers() -> dict[str, dict]:
    """{model key: header fields} for every generated file, from the file headers."""
    import generated

    models = {}
    for arch, target in generated.architectures().items():
        module, cls = target.split(":")
        key = module.split(".")[-1]
        text = (Path(generated.__file__).parent / f"{key}.py").read_text()
        head = text[:8192]
        source = re.search(r"^# source:\s+(.+)$", head, re.MULTILINE)
        models[key] = {
            "generated_arch": arch,
            "generated_class": target,
            "hf_arch": cls,
            "source": source.group(1).strip() if source else None,
            "file_sha256": file_sha(text),
            # what the file's header says vLLM must run it with (VLLM_MLA_DISABLE=1)
            "environment": dict(
                re.findall(r"^# environment:\s+(\w+)=(\S+)", head, re.MULTILINE)
            ),
            # layers with a state cache (Mamba): vLLM 0.32's CPU chunked scan returns
            # no per-block states, which prefix caching's "align" mode indexes
            # (IndexError in vLLM's own class as in this one): every implementation
            # runs without prefix caching
            "state_cache": "HasInnerState" in text,
            # the one dtype vLLM's CPU build runs the file in (its GDN kernels: bf16)
            "cpu_dtype": next(
                iter(re.findall(r"^# cpu dtype:\s+(\w+)", head, re.MULTILINE)), None
            ),
        }
    return dict(sorted(models.items()))


def file_sha(text: str) -> str:
    from codemods.check import sha

    return sha(text)


def current_sha(key: str) -> str | None:
    path = REPO / "generated" / f"{key}.py"
    return file_sha(path.read_text()) if path.exists() else None


def causal_class(source: str, hf_arch: str):
    """The transformers class the generated file was made from."""
    import importlib

    import transformers

    if source and source.startswith("transformers/") and source.endswith(".py"):
        module = importlib.import_module(source[: -len(".py")].replace("/", "."))
        return getattr(module, hf_arch)
    return getattr(transformers, hf_arch)  # a file from elsewhere: the installed class


def config_sizes(config_cls, sizes: dict) -> tuple[dict, list[str]]:
    """The config kwargs setting `sizes` under the names this class uses; sizes it has no
    field for are skipped (and reported), every other default is left alone."""
    fields = config_cls().to_dict()
    attribute_map = getattr(config_cls, "attribute_map", {}) or {}
    kwargs, skipped = {}, []
    for name, value in sizes.items():
        if name == "head_dim" and name in attribute_map:
            # a head size the class derives under its own name (Zamba 2's, from its
            # doubled attention width): left to it
            continue
        names = (name, attribute_map.get(name), *SIZE_ALIASES.get(name, ()))
        field = next((n for n in names if n and n in fields), None)
        if field is None:
            if name not in OPTIONAL_SIZES:  # MoE/MLA sizes only MoE/MLA classes have
                skipped.append(name)
        else:
            kwargs[field] = value
    # special token ids past the shrunk vocabulary (an embedding padding_idx must fit)
    vocab = kwargs.get("vocab_size", sizes["vocab_size"])
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = fields.get(key)
        if isinstance(value, int) and value >= vocab:
            kwargs[key] = vocab - 1
        elif isinstance(value, list) and any(v >= vocab for v in value):
            kwargs[key] = [min(v, vocab - 1) for v in value]
    return kwargs, skipped


def parse_overrides(items: list[str]) -> dict:
    """`--override KEY=JSON`, read as verify reads them (its one-line errors)."""
    from codemods.verify import parse_override

    return dict(parse_override(item) for item in items or [])


def every_layer_kind(source: str, layers: int) -> dict:
    """The layer-type lists verify's tiny config mixes so that every kind of layer the
    source can build is built (LFM2's `conv` layers beside `full_attention`, which its
    config's default never builds), repeated over the benchmark's depth: a benchmark of
    a hybrid model times its mixers, not only its attention (taken for models with a
    state cache only: the others' rows keep the checkpoints they were measured on). {}
    where the toolkit cannot tell."""
    from codemods import layer_kinds, loading, tiny
    from codemods.roles import causal_class as toolkit_causal
    from codemods.source import load

    try:
        src = load(os.path.basename(source))
        pymodule = loading.load_module(src, trust_remote_code=False)
        causal = toolkit_causal(pymodule, src.classes, src)
        values = tiny.working_values(causal)
        primary = layer_kinds.cover(causal, src.module, src.classes, values).primary
    except Exception:  # noqa: BLE001 - no cover: the config's own defaults
        return {}
    depth = primary.get("num_hidden_layers")
    return {
        k: (v * layers)[:layers]
        for k, v in primary.items()
        if isinstance(v, list)
        and len(v) == depth
        and len(set(map(str, v))) > 1
        and all(isinstance(x, str) for x in v)
    }


def build_checkpoint(
    causal_cls,
    sizes: dict,
    out_dir: str,
    seed: int,
    dtype,
    overrides=None,
    source: str | None = None,
) -> dict:
    import torch

    from codemods.tiny import fit_latent_attention, fit_layer_kinds

    config_cls = causal_cls.config_class
    kwargs, skipped = config_sizes(config_cls, sizes)
    defaults = config_cls().to_dict()
    fit_latent_attention(kwargs, defaults)
    # a layer-type list under the class's own name, filled for its full depth
    attribute_map = getattr(config_cls, "attribute_map", {}) or {}
    fit_layer_kinds(kwargs, defaults, attribute_map.get("layer_types"))
    if source and "num_hidden_layers" in kwargs:
        for key, kinds in every_layer_kind(source, kwargs["num_hidden_layers"]).items():
            kwargs.setdefault(key, kinds)
    kwargs.update(overrides or {})
    torch.manual_seed(seed)
    try:
        config = config_cls(**kwargs)
        layers = getattr(config, "num_hidden_layers", None)
        types = getattr(config, "layer_types", None)
        if isinstance(types, list) and layers and len(types) != layers:
            # a class whose default layer pattern does not follow the layer count
            kwargs["layer_types"] = (types * layers)[:layers]
            config = config_cls(**kwargs)
        model = causal_cls(config).eval()
    except Exception:  # noqa: BLE001 - a default the source cannot build with
        # the tiny rules' fallbacks for it (DBRX's sub-configs without a rope theta,
        # Mamba 2's heads validated against its width), on these sizes and the
        # defaults' sub-configs
        model, kwargs, config = _first_that_builds(causal_cls, kwargs, defaults)
    config.architectures = [causal_cls.__name__]
    params = sum(p.numel() for p in model.parameters())
    model.to(dtype)  # the benchmark's dtype: half the disk and load time for bf16
    model.save_pretrained(out_dir, safe_serialization=True)
    return {
        "dir": out_dir,
        "config": kwargs,
        "sizes_not_set": skipped,
        "vocab_size": getattr(config, "vocab_size", sizes["vocab_size"]),
        "parameters": params,
    }


def _first_that_builds(causal_cls, kwargs: dict, defaults: dict):
    from codemods.tiny import variants, working_values

    # the sub-configs (DBRX's attn_config / ffn_config) as the tiny model builds them
    subs = {
        k: v
        for k, v in working_values(causal_cls).items()
        if isinstance(v, dict)
        and isinstance(defaults.get(k), dict)
        and k not in kwargs
        and k != "rope_parameters"
    }
    error = None
    for values in variants(causal_cls.config_class, {**kwargs, **subs}):
        try:
            config = causal_cls.config_class(**values)
            return causal_cls(config).eval(), values, config
        except Exception as exc:  # noqa: BLE001 - the next fallback
            error = error or exc
    raise error


def native_class(hf_arch: str) -> str | None:
    """vLLM's own class for `hf_arch` ("module:qualname"), or None when vLLM serves that
    architecture only through the Transformers backend (or not at all)."""
    from codemods.vllm_native import native_class as found

    cls = found(hf_arch)
    return f"{cls.__module__}:{cls.__qualname__}" if cls is not None else None


def prime_model_info(archs: list[str]) -> None:
    """vLLM inspects a model class in a subprocess unless its file's hash is cached; fill
    that cache now so no implementation pays it inside a timed start-up."""
    from vllm import ModelRegistry

    for arch in archs:
        entry = ModelRegistry.models.get(arch)
        if entry is not None:
            entry.inspect_model_cls()


def amx_off() -> bool:
    """CODEMODS_NO_AMX=1 on a CPU with AMX tiles: vLLM's AMX kernels are off for every
    implementation of the run (vLLM 0.32 loads an fp32 latent attention only so: its
    AMX MLA backend packs bf16/fp16 weights only, the native class's as much)."""
    if os.environ.get("CODEMODS_NO_AMX") != "1":
        return False
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def machine_info(device: str) -> dict:
    import torch
    import transformers
    import vllm

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1
        ),
        "device": device,
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
        "python": platform.python_version(),
        "os": platform.platform(),
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "transformers": transformers.__version__,
    }
    return info


def prepare_job(job: dict) -> dict:
    """The device, the machine, and the models to run with their implementations."""
    import torch
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers the Generated* classes in this process
    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = read_generated_headers()
    if job["models"]:
        unknown = sorted(set(job["models"]) - set(models))
        if unknown:
            raise ValueError(
                f"no generated model {', '.join(unknown)} (have: {', '.join(models)})"
            )
        models = {k: v for k, v in models.items() if k in job["models"]}
    for model in models.values():
        if device == "cpu" and model.get("cpu_dtype"):
            # every implementation of it runs in that dtype: like against like
            model["dtype"] = model["cpu_dtype"]
        if device == "cpu" and amx_off():
            model["amx_off"] = True
        try:
            model["native_class"] = native_class(model["hf_arch"])
        except (
            Exception
        ) as exc:  # one model that cannot be set up must not stop the rest
            model["error"] = f"vLLM registry: {type(exc).__name__}: {exc}"
    return {"device": device, "machine": machine_info(device), "models": models}


def checkpoint_job(job: dict) -> dict:
    """One model's checkpoint, shared by all its runs (and deleted after them)."""
    import torch
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    model = job["model"]
    causal = causal_class(model["source"], model["hf_arch"])
    dtype = getattr(torch, model.get("dtype") or job["settings"]["dtype"])
    ckpt = build_checkpoint(
        causal,
        job["settings"]["sizes"],
        job["dir"],
        job["seed"],
        dtype,
        model.get("overrides"),
        # a model with a state cache: its mixers built beside its attention
        model["source"] if model.get("state_cache") else None,
    )
    prime = [model["generated_arch"], "TransformersForCausalLM"]
    prime_model_info(prime + ([model["hf_arch"]] if model["native_class"] else []))
    return ckpt


# ---------------------------------------------------------------------------------------
# One benchmark run (one child per model, implementation and repeat).


def time_model_loading(timings: dict) -> None:
    """Time vLLM's model construction and whole model load (construction, weights,
    post-processing). The engine runs in this process, so a patch here sees them."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    create, load = BaseModelLoader.create_model, BaseModelLoader.load_model

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timings[key] = time.perf_counter() - start

        return wrapper

    BaseModelLoader.create_model = timed(create, "construct_s")
    BaseModelLoader.load_model = timed(load, "load_s")


def check_class(impl: str, ran: list[str], model: dict) -> None:
    """Fail unless the run used the implementation it is labelled with."""
    if len(ran) != 1:
        raise RuntimeError(f"ranks ran different classes: {ran}")
    got = ran[0]
    if impl == "transformers":
        module = got.split(":")[0]
        ok = module == TRANSFORMERS_BACKEND or module.startswith(
            TRANSFORMERS_BACKEND + "."
        )
        want = f"a class of {TRANSFORMERS_BACKEND}"
    else:
        want = model[f"{impl}_class"]
        ok = got == want
    if not ok:
        raise RuntimeError(f"{impl} run ran {got}, expected {want}")


def token_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def measure_throughput(llm, case: dict, vocab: int, seed: int) -> dict:
    from vllm import SamplingParams

    prompts = token_prompts(case["requests"], case["prompt"], vocab, seed)
    params = SamplingParams(
        temperature=0, max_tokens=case["output"], ignore_eos=True, detokenize=False
    )
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != case["requests"] * case["output"]:
        raise RuntimeError(f"throughput case produced {produced} tokens")
    total = case["requests"] * case["prompt"] + produced
    return {
        "throughput_s": seconds,
        "throughput_tok_s": total / seconds,
        "output_tok_s": produced / seconds,
    }


def measure_latency(llm, case: dict, vocab: int, seed: int) -> dict:
    """One request at a time through the engine's step loop, with a timestamp for every
    token as it comes out (DELTA outputs); LLM.generate only returns finished requests.
    """
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    ttfts, gaps = [], []
    prompts = token_prompts(case["requests"], case["prompt"], vocab, seed)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=0,
            max_tokens=case["output"],
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        stamps = []
        start = time.perf_counter()
        engine.add_request(f"latency-{i}", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                stamps += [now] * len(out.outputs[0].token_ids)
        if len(stamps) != case["output"]:
            raise RuntimeError(f"latency request produced {len(stamps)} tokens")
        ttfts.append(stamps[0] - start)
        gaps += [b - a for a, b in zip(stamps, stamps[1:])]
    return {
        "ttft_ms": 1e3 * statistics.median(ttfts),
        "itl_ms": 1e3 * statistics.median(gaps),
        "itl_mean_ms": 1e3 * statistics.fmean(gaps),
        "ttft_all_ms": [1e3 * t for t in ttfts],
    }


def run_job(job: dict) -> dict:
    import torch

    timings: dict = {}
    time_model_loading(timings)
    from vllm import LLM, SamplingParams

    from codemods.engine import model_class_name

    model, impl, settings = job["model"], job["impl"], job["settings"]
    kwargs = {
        "model": model["checkpoint"]["dir"],
        "skip_tokenizer_init": True,
        "dtype": model.get("dtype") or settings["dtype"],
        "max_model_len": settings["max_model_len"],
        "seed": job["seed"],
        "enforce_eager": settings["eager"],
    }
    if model.get("state_cache") and not torch.cuda.is_available():
        kwargs["enable_prefix_caching"] = False
    if impl == "generated":
        kwargs["hf_overrides"] = {"architectures": [model["generated_arch"]]}
        # this run's own process: the others run as vLLM would by default
        os.environ.update(model.get("environment", {}))
    elif impl == "native":
        kwargs["hf_overrides"] = {"architectures": [model["hf_arch"]]}
    else:
        kwargs["model_impl"] = "transformers"
    start = time.perf_counter()
    llm = LLM(**kwargs)
    startup = time.perf_counter() - start
    ran = sorted(set(llm.apply_model(model_class_name)))
    check_class(impl, ran, model)

    vocab = model["checkpoint"]["vocab_size"]
    seed = job["seed"]
    # the first generate pays lazy initialisation; keep it out of the numbers
    warm = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, detokenize=False
    )
    llm.generate(
        [{"prompt_token_ids": p} for p in token_prompts(2, 16, vocab, seed + 1)],
        warm,
        use_tqdm=False,
    )
    result = {"class": ran[0], "startup_s": startup, "threads": torch.get_num_threads()}
    result["construct_s"] = timings.get("construct_s")
    if "load_s" in timings and "construct_s" in timings:
        result["weights_s"] = timings["load_s"] - timings["construct_s"]
    result.update(measure_throughput(llm, settings["throughput"], vocab, seed + 2))
    result.update(measure_latency(llm, settings["latency"], vocab, seed + 3))
    return result


# ---------------------------------------------------------------------------------------
# The toolkit's own speed: each command in a fresh interpreter, as a user runs it.


def time_command(args: list[str], env: dict | None = None) -> dict:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    out = {"seconds": time.perf_counter() - start, "exit": proc.returncode}
    if proc.returncode:
        out["stderr"] = "\n".join(proc.stderr.strip().splitlines()[-5:])
    return out


def time_toolkit(workdir: Path, warm_repeats: int) -> dict:
    apply = time_command(
        ["-m", "codemods.apply", "modeling_qwen3.py", "--out", str(workdir / "apply")]
    )
    # codemods.check keeps its cache under $XDG_CACHE_HOME: an empty one is a cold cache.
    # vLLM and Hugging Face derive their caches from it too; keep those where they were.
    cache_root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    env = {
        **os.environ,
        "XDG_CACHE_HOME": str(workdir / "xdg-cache"),
        "VLLM_CACHE_ROOT": os.environ.get(
            "VLLM_CACHE_ROOT", os.path.join(cache_root, "vllm")
        ),
        "HF_HOME": os.environ.get("HF_HOME", os.path.join(cache_root, "huggingface")),
    }
    cold = time_command(["-m", "codemods.check"], env)
    warm = [time_command(["-m", "codemods.check"], env) for _ in range(warm_repeats)]
    manifest = json.loads((REPO / "generated" / "manifest.json").read_text())
    return {
        "check_models": len(manifest),
        "apply_qwen3": apply,
        "check_cold": cold,
        "check_warm": {
            "seconds": statistics.median(w["seconds"] for w in warm),
            "runs": [w["seconds"] for w in warm],
            "exit": max(w["exit"] for w in warm),
        },
    }


# ---------------------------------------------------------------------------------------
# Statistics.


def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def summarize(runs: list[dict], models: dict) -> tuple[dict, dict]:
    """Per model and implementation: median and min-max of every metric. Ratios are
    speed-ups of the generated class (>1: generated is faster), from runs of the same
    repeat (neighbours in time), so slow phases of the machine hit both sides."""
    ok = [r for r in runs if "error" not in r]
    summary, ratios = {}, {}
    for key in models:
        summary[key] = {}
        for impl in IMPLS:
            mine = [r for r in ok if r["model"] == key and r["impl"] == impl]
            if mine:
                summary[key][impl] = {
                    m: spread([r[m] for r in mine if r.get(m) is not None])
                    for m, *_ in METRICS
                }
        ratios[key] = {}
        for other in ("native", "transformers"):
            per_metric = {}
            for metric, _, _, higher in METRICS:
                values = []
                for rep in sorted({r["repeat"] for r in ok if r["model"] == key}):
                    pair = {
                        r["impl"]: r.get(metric)
                        for r in ok
                        if r["model"] == key and r["repeat"] == rep
                    }
                    gen, base = pair.get("generated"), pair.get(other)
                    if gen and base:
                        values.append(gen / base if higher else base / gen)
                if values:
                    per_metric[metric] = spread(values)
            if per_metric:
                ratios[key][f"vs_{other}"] = per_metric
    return summary, ratios


# ---------------------------------------------------------------------------------------
# Reports: markdown, plot, README.


def fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "tok/s":
        return f"{value:.0f}"
    if unit == "ms":
        return f"{value:.1f}"
    return f"{value:.2f}"


def fmt_spread(s: dict | None, unit: str) -> str:
    if not s:
        return "-"
    if s["n"] == 1:
        return fmt(s["median"], unit)
    return f"{fmt(s['median'], unit)} ({fmt(s['min'], unit)}-{fmt(s['max'], unit)})"


def fmt_ratio(r: dict | None) -> str:
    if not r:
        return "-"
    if r["n"] == 1:
        return f"{r['median']:.2f}x"
    return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def machine_line(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    device = m["gpu"] or m["cpu"]
    models = results["models"].values()
    dates = sorted(
        {x.get("date", results["date"]) for x in models} or {results["date"]}
    )
    repeats = sorted({x.get("repeats", s["repeats"]) for x in models} or {s["repeats"]})
    return (
        f"{device}, {m['cpus_usable']} cores, {m['device']}, {s['dtype']}, "
        f"{'eager' if s['eager'] else 'compiled'}; torch {m['torch']}, vllm {m['vllm']}, "
        f"transformers {m['transformers']}; {'/'.join(map(str, repeats))} repeat(s), "
        + (dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}")
        + (
            "; rows marked (on ...) were measured on that CPU"
            if any(x.get("machine", m["cpu"]) != m["cpu"] for x in models)
            else ""
        )
    )


def model_cell(key: str, model: dict, machine: str | None = None) -> str:
    """The model's name, the CPU it ran on where that is not `machine` (the one the
    results were last measured on), and when the committed file is not the one the row
    ran."""
    recorded, when = model.get("file_sha256"), model.get("date")
    if model.get("overrides"):
        key += (
            " ("
            + ", ".join(f"{k}={json.dumps(v)}" for k, v in model["overrides"].items())
            + ")"
        )
    if model.get("dtype"):
        key += f" (in {model['dtype']})"
    if model.get("amx_off"):
        key += " (AMX kernels off)"
    if machine and model.get("machine") and model["machine"] != machine:
        key += f" (on {model['machine']})"
    if recorded and recorded == current_sha(key.split(" ")[0]):
        return key
    if recorded:
        return f"{key} (ran {when} on an earlier file)"
    return f"{key} (ran {when}, its file not recorded)" if when else key


def error_line(error: str) -> str:
    """An error's most telling line, short (see `codemods.errors.error_line`)."""
    from codemods.errors import error_line as telling

    return telling(error)[:160]


# vLLM failures reported upstream: (the error's telling text, where it is reported and
# why no checkpoint can avoid it), so a row says the gap is vLLM's, not the benchmark's
UPSTREAM = (
    (
        "'blocks.0.ffn.experts.w13_weight'",
        "vllm-project/vllm#49004: DbrxModel.load_weights misses the MoE's "
        "routed_experts prefix, so no DBRX checkpoint loads",
    ),
)


def not_compared(results: dict, key: str, other: str) -> str:
    """Why a model's row has no ratios against `other`: vLLM has no such class, the run
    failed (its first error), or the model was not run."""
    model = results["models"][key]
    if "error" in model:
        return f"not run: {error_line(model['error'])}"
    if other == "native" and not model.get("native_class"):
        return "no native class"
    failed = [r for r in results["runs"] if r["model"] == key and "error" in r]
    mine = [r for r in failed if r["impl"] == other]
    if mine:
        what = (
            "vLLM's native class fails"
            if other == "native"
            else ("backend cannot serve it")
        )
        line = error_line(mine[0]["error"])
        known = [why for text, why in UPSTREAM if text in mine[0]["error"]]
        return f"{what}: {line}" + (f" (known upstream: {known[0]})" if known else "")
    if failed:
        return f"generated run failed: {error_line(failed[0]['error'])}"
    return "not compared"


def target(ratios: dict, other: str) -> str:
    """The issue's target on the serving metrics: generated >= 1.00x native within the
    measured spread (the best paired ratio reaches 1), faster than the Transformers
    backend (median ratio above 1)."""
    missed = []
    for metric in TARGET_METRICS:
        r = ratios.get(metric)
        if r is None:
            continue
        ok = r["max"] >= 1.0 if other == "native" else r["median"] > 1.0
        if not ok:
            missed.append(LABELS[metric])
    return "met" if not missed else "missed: " + ", ".join(missed)


def ratio_table(results: dict, other: str) -> list[str]:
    head = "| model | " + " | ".join(LABELS[m] for m in README_METRICS) + " | target |"
    rows = [head, "| --- |" + " --- |" * (len(README_METRICS) + 1)]
    for key in sorted(results["models"]):
        ratios = results["ratios"].get(key, {}).get(f"vs_{other}")
        if ratios:
            cells = [fmt_ratio(ratios.get(m)) for m in README_METRICS]
            cells.append(target(ratios, other))
        else:
            cells = ["-"] * len(README_METRICS) + [not_compared(results, key, other)]
        cell = model_cell(key, results["models"][key], results["machine"]["cpu"])
        rows.append(f"| {cell} | " + " | ".join(cells) + " |")
    return rows if len(rows) > 2 else []


def absolute_table(results: dict) -> list[str]:
    head = "| model | implementation | " + " | ".join(
        f"{label} ({unit})" for _, label, unit, _ in METRICS
    )
    rows = [head + " |", "| --- | --- |" + " --- |" * len(METRICS)]
    for key, per_impl in results["summary"].items():
        for impl, stats in per_impl.items():
            cells = []
            for metric, _, unit, _ in METRICS:
                s = stats.get(metric)
                cells.append(fmt_spread(s, unit))
            other = results["models"].get(key, {}).get("machine")
            if other and other != results["machine"]["cpu"]:
                key_cell = f"{key} (on {other})"
            else:
                key_cell = key
            rows.append(
                f"| {key_cell} | {IMPL_LABELS[impl]} | " + " | ".join(cells) + " |"
            )
    return rows


def busy_note(results: dict) -> str:
    busy = [r for r in results["runs"] if (r.get("other_cpu_share") or 0) > BUSY]
    if not busy:
        return ""
    worst = max(r["other_cpu_share"] for r in busy)
    return (
        f"**Warning: in {len(busy)} of {len(results['runs'])} runs other processes used "
        f"more than {BUSY:.0%} of the CPU (up to {worst:.0%}); those numbers are skewed.**"
    )


def toolkit_line(results: dict) -> str:
    t = results.get("toolkit")
    if not t:
        return ""
    n = t["check_models"]

    def cmd(entry):
        text = f"{entry['seconds']:.1f} s"
        return text + (f" (exit {entry['exit']})" if entry["exit"] else "")

    return (
        f"Toolkit: `codemods.apply modeling_qwen3.py` {cmd(t['apply_qwen3'])}; "
        f"`codemods.check` ({n} models) cold {cmd(t['check_cold'])}, "
        f"warm {cmd(t['check_warm'])}."
    )


def readme_section(results: dict, plot: Path) -> str:
    lines = [f"Measured on: {machine_line(results)}.", ""]
    lines += [
        "Speed-up of the generated class (median of per-repeat ratios, min-max; >1: "
        "generated faster), against vLLM's native class:",
        "",
    ]
    lines += ratio_table(results, "native") or ["(no runs to compare)"]
    lines += ["", "Against the Transformers backend:", ""]
    lines += ratio_table(results, "transformers") or ["(no runs to compare)"]
    lines += ["", *([toolkit_line(results), ""] if results.get("toolkit") else [])]
    rel = os.path.relpath(plot, REPO)
    md = os.path.relpath(plot.parent / "results.md", REPO)
    lines += [f"![speed-ups]({rel})", "", f"Absolute numbers, every run: [{md}]({md})."]
    if note := busy_note(results):
        lines += ["", note]
    errors = [r for r in results["runs"] if "error" in r]
    errors += [m for m in results["models"].values() if "error" in m]
    if errors:
        lines += ["", f"**{len(errors)} failure(s)**; see {md}."]
    return "\n".join(lines)


def write_markdown(results: dict, path: Path) -> None:
    s = results["settings"]
    t, lat = s["throughput"], s["latency"]
    lines = [
        "# Benchmark results",
        "",
        f"Machine: {machine_line(results)}.",
        "",
        f"Checkpoint sizes (random weights, one per model): {json.dumps(s['sizes'])}.",
        f"Throughput case: {t['requests']} requests x {t['prompt']} prompt tokens x "
        f"{t['output']} output tokens, all at once (prompt + output tokens per second).",
        f"Latency case: {lat['requests']} requests one at a time, {lat['prompt']} prompt "
        f"tokens, {lat['output']} output tokens (median TTFT, median inter-token gap).",
        "",
        "## Speed-up of the generated class vs vLLM native",
        "",
        *(ratio_table(results, "native") or ["(no runs to compare)"]),
        "",
        "## Speed-up of the generated class vs the Transformers backend",
        "",
        *(ratio_table(results, "transformers") or ["(no runs to compare)"]),
        "",
        "## Absolute numbers: median (min-max)",
        "",
        *absolute_table(results),
        "",
        toolkit_line(results),
    ]
    if note := busy_note(results):
        lines += ["", note]
    skipped = {k: m["error"] for k, m in results["models"].items() if "error" in m}
    if skipped:
        lines += ["", "## Models not run", ""]
        lines += [f"- {k}: {e}" for k, e in skipped.items()]
    errors = [r for r in results["runs"] if "error" in r]
    if errors:
        lines += ["", "## Failed runs", ""]
        lines += [
            f"- {r['model']} / {r['impl']} / repeat {r['repeat']}: {r['error']}"
            for r in errors
        ]
    path.write_text("\n".join(lines) + "\n")


FINE_TICKS = (0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 7)
COARSE_TICKS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)


def _x_label(value: float, _pos) -> str:
    return f"{value:g}x"


def write_plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    panels = [
        (other, title)
        for other, title in (
            ("native", "generated vs vLLM native"),
            ("transformers", "generated vs Transformers backend"),
        )
        if any(f"vs_{other}" in r for r in results["ratios"].values())
    ]
    if not panels:  # every run failed: say so rather than leave an old plot behind
        fig = plt.figure(figsize=(6, 1.5))
        fig.text(0.5, 0.5, "no successful runs to compare", ha="center")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return
    metrics = [m for m in METRICS if m[0] != "weights_s"]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(10, 3.8 * len(panels)), squeeze=False
    )
    step = 0.7 / len(metrics)
    for ax, (other, title) in zip(axes[:, 0], panels):
        keys = [k for k, r in results["ratios"].items() if f"vs_{other}" in r]
        for j, (metric, label, _, _) in enumerate(metrics):
            xs, meds, lo, hi = [], [], [], []
            for i, key in enumerate(keys):
                r = results["ratios"][key][f"vs_{other}"].get(metric)
                if r:
                    xs.append(i + (j - (len(metrics) - 1) / 2) * step)
                    meds.append(r["median"])
                    lo.append(r["median"] - r["min"])
                    hi.append(r["max"] - r["median"])
            ax.errorbar(xs, meds, yerr=[lo, hi], fmt="o", capsize=3, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        # log scale: 2x faster and 2x slower are the same distance from 1
        ax.set_yscale("log")
        bottom, top = ax.get_ylim()
        bottom, top = min(bottom, 0.9), max(top, 1.1)
        ax.set_ylim(bottom, top)
        fine = [t for t in FINE_TICKS if bottom <= t <= top]
        ticks = (
            fine
            if top / bottom < 10
            else [t for t in COARSE_TICKS if bottom <= t <= top]
        )
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(_x_label))
        ax.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(range(len(keys)), keys)
        ax.set_xlim(-0.5, len(keys) - 0.5)
        ax.set_ylabel("speed-up, >1: generated faster")
        ax.set_title(title + " (median, min-max over repeats)")
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.legend(
            fontsize=8,
            ncol=len(metrics),
            loc="upper center",
            bbox_to_anchor=(0.5, -0.12),
            frameon=False,
        )
    fig.suptitle(machine_line(results), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def update_readme(section: str) -> None:
    readme = REPO / "README.md"
    text = readme.read_text()
    start, end = text.find(README_START), text.find(README_END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no {README_START} ... {README_END} markers")
    text = text[: start + len(README_START)] + "\n" + section + "\n" + text[end:]
    readme.write_text(text)


def render(results: dict, out: Path, readme: bool) -> None:
    write_markdown(results, out / "results.md")
    write_plot(results, out / "ratios.png")
    if readme:
        update_readme(readme_section(results, out / "ratios.png"))


# ---------------------------------------------------------------------------------------


def run_model(ctx, key: str, model: dict, settings: dict, args, workdir: Path) -> list:
    """Every run of one model: repeats x implementations, alternating (A B C A B C)."""
    impls = [i for i in IMPLS if i != "native" or model["native_class"]]
    runs = []
    for rep in range(1, settings["repeats"] + 1):
        for impl in impls:
            job = {
                "model": model,
                "impl": impl,
                "settings": settings,
                "seed": args.seed,
            }
            load = os.getloadavg()[0]  # other work on the machine skews every number
            start = time.perf_counter()
            result = run_child(
                ctx, run_job, job, workdir, f"run-{key}-{impl}-{rep}", args.timeout
            )
            run = {
                "model": key,
                "impl": impl,
                "repeat": rep,
                "loadavg_before": load,
                "run_s": time.perf_counter() - start,
                **result,
            }
            runs.append(run)
            print_run(run)
            if "error" in run and run.get("log"):
                print("    " + run["log"][-3000:].replace("\n", "\n    "), flush=True)
    return runs


def set_env() -> None:
    """Same engine settings for every implementation."""
    # Engine core and worker in the run's own process: `LLM()` starts in seconds instead
    # of ~25 s, no engine-core process competes with the worker for the 2 cores, and the
    # construction/loading timers (patched in that process) see the model being built.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; read on CPU only


def print_run(run: dict) -> None:
    head = f"  {run['model']} {run['impl']} repeat {run['repeat']}"
    head += f" ({run['run_s']:.0f} s):"
    if "error" in run:
        print(f"{head} ERROR {run['error']}", flush=True)
        return
    busy = run.get("other_cpu_share") or 0
    print(
        f"{head} {run['throughput_tok_s']:.0f} tok/s, TTFT {run['ttft_ms']:.1f} ms, "
        f"ITL {run['itl_ms']:.1f} ms, LLM() {run['startup_s']:.1f} s "
        f"(construct {fmt(run.get('construct_s'))} s)"
        + (
            f"; BUSY: other processes used {busy:.0%} of the CPU" if busy > BUSY else ""
        ),
        flush=True,
    )


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split())
    )
    parser.add_argument(
        "--models",
        help="comma-separated, e.g. qwen3,llama; `all` for every generated model "
        f"(default: {','.join(DEFAULT_MODELS)})",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="run the models an interrupted run left (results.json's in_progress)",
    )
    parser.add_argument(
        "--repeats", type=int, help="runs per implementation (default 3)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "benchmarks",
        help="results.json, results.md, ratios.png (default: benchmarks/)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="set a config field of every model this run builds (repeatable); the "
        "rows name it (a native class that needs it: zamba2's kv heads = heads)",
    )
    parser.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        help="enforce_eager (default: on for CPU, where torch.compile adds ~35 s to every "
        "start on 2 cores; off for CUDA, i.e. vLLM's compile + CUDA graphs)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument(
        "--no-toolkit", action="store_true", help="skip the toolkit timing"
    )
    parser.add_argument(
        "--update-readme",
        action="store_true",
        help="replace README.md's benchmark section (between its markers)",
    )
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="rewrite results.md, ratios.png (and README) from OUT/results.json",
    )
    return parser.parse_args(argv)


def make_settings(device: str, args) -> dict:
    preset = "quick" if args.quick else device
    return {
        "preset": preset,
        # fp32 on CPU: bf16 is several times slower on a CPU without AVX-512 BF16
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "eager": args.eager if args.eager is not None else device == "cpu",
        "repeats": args.repeats or (1 if args.quick else 3),
        "seed": args.seed,
        **PRESETS[preset],
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
    }


def print_plan(models: dict, repeats: int) -> None:
    runs = 0
    for key, m in models.items():
        runs += 0 if "error" in m else repeats * (3 if m["native_class"] else 2)
        if "error" in m:
            impls = f"SKIPPED: {m['error']}"
        elif m["native_class"]:
            impls = "generated, native, transformers"
        else:
            impls = "generated, transformers (vLLM has no native class)"
        print(f"{key}: {m['hf_arch']} from {m['source']}: {impls}", flush=True)
    print(f"{runs} runs, {repeats} per implementation", flush=True)


def benchmark_models(
    ctx, models: dict, settings: dict, args, workdir: Path, done
) -> list:
    """Per model: build its checkpoint, run every implementation on it, delete it;
    `done(key, runs)` after each (the results saved so far)."""
    runs = []
    overrides = args.overrides
    for key, model in models.items():
        model.update(date=time.strftime("%Y-%m-%d"), repeats=settings["repeats"])
        if overrides:
            model["overrides"] = overrides
        if "error" in model:
            done(key, [])
            continue
        job = {
            "model": model,
            "settings": settings,
            "seed": args.seed,
            "dir": str(workdir / f"ckpt-{key}"),
        }
        print(f"{key}: building the checkpoint ...", flush=True)
        ckpt = run_child(ctx, checkpoint_job, job, workdir, f"ckpt-{key}", args.timeout)
        if "error" in ckpt:
            model["error"] = f"checkpoint: {ckpt['error']}"
            print(f"{key}: SKIPPED: {model['error']}\n{ckpt.get('log', '')}")
            done(key, [])
            continue
        model["checkpoint"] = ckpt
        mine = run_model(ctx, key, model, settings, args, workdir)
        shutil.rmtree(ckpt["dir"], ignore_errors=True)  # GPU-size ones are GBs
        runs += mine
        done(key, mine)
    return runs


def merged(old: dict | None, new: dict) -> dict:
    """`new`'s models replace theirs in `old` (entries and runs) and the others stay as
    they were measured; summary and ratios over all of them. Results under other
    settings or on another kind of device are not comparable: `new` alone. A row kept
    from another CPU keeps its ratios (each measured side by side in its own run) and
    names that CPU."""
    if not old or any(
        old["settings"].get(k) != new["settings"].get(k) for k in COMPARABLE
    ):
        return new
    if old["machine"].get("device") != new["machine"].get("device"):
        return new
    ran = set(new["models"])
    models = {
        **{
            k: {"date": old["date"], "machine": old["machine"]["cpu"], **m}
            for k, m in old["models"].items()
            if k not in ran
        },
        **new["models"],
    }
    models = dict(sorted(models.items()))
    runs = [r for r in old["runs"] if r["model"] not in ran] + new["runs"]
    summary, ratios = summarize(runs, models)
    return {
        **new,
        "models": models,
        "runs": runs,
        "summary": summary,
        "ratios": ratios,
        "toolkit": new.get("toolkit") or old.get("toolkit"),
    }


def load_results(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    if args.render_only:
        results = json.loads(path.read_text())
        render(results, args.out, args.update_readme)
        return 0
    if args.resume:
        pending = (load_results(path) or {}).get("in_progress")
        if not pending:
            print(f"error: {path} has no interrupted run to resume", file=sys.stderr)
            return 2
        args.models = ",".join(pending["models"])
        args.repeats, args.quick = pending["repeats"], pending["quick"]
        args.no_toolkit = args.no_toolkit or pending["toolkit_done"]
        args.override = pending.get("overrides", [])
        print(f"resuming: {args.models}", flush=True)
    from codemods.errors import CodemodError

    try:
        args.overrides = parse_overrides(args.override)
    except CodemodError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    began = time.perf_counter()
    set_env()
    if os.getloadavg()[0] > 0.5:
        print(
            f"warning: load average {os.getloadavg()[0]:.1f}: other work on this machine "
            "will skew the numbers (on 2 cores, decode slows down many times over)",
            flush=True,
        )
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["vllm.entrypoints.llm", "transformers"])
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        workdir = Path(tmp)
        if args.models == "all":
            wanted = None
        else:
            wanted = args.models.split(",") if args.models else list(DEFAULT_MODELS)
        print("finding the generated models ...", flush=True)
        prep = run_child(
            ctx, prepare_job, {"models": wanted}, workdir, "prepare", args.timeout
        )
        if "error" in prep:
            print(f"error: {prep['error']}\n{prep.get('log', '')}", file=sys.stderr)
            return 2
        models = prep["models"]
        settings = make_settings(prep["device"], args)
        print_plan(models, settings["repeats"])
        toolkit = None
        if not args.no_toolkit:
            print("timing the toolkit (apply, check cold, check warm) ...", flush=True)
            toolkit = time_toolkit(workdir, warm_repeats=3)
        finished: dict = {}
        all_runs: list = []

        def done(key: str | None, runs: list) -> None:
            """Merge what has run into results.json; what has not is `in_progress`."""
            if key is not None:
                finished[key] = models[key]
                all_runs.extend(runs)
            summary, ratios = summarize(all_runs, finished)
            new = {
                "date": time.strftime("%Y-%m-%d"),
                "machine": prep["machine"],
                "settings": settings,
                "models": dict(finished),
                "runs": list(all_runs),
                "summary": summary,
                "ratios": ratios,
                "toolkit": toolkit,
                "total_seconds": time.perf_counter() - began,
            }
            results = merged(load_results(path), new)
            results.pop("in_progress", None)
            left = [k for k in models if k not in finished]
            if left:
                results["in_progress"] = {
                    "models": left,
                    "repeats": settings["repeats"],
                    "quick": settings["preset"] == "quick",
                    "toolkit_done": True,
                    "overrides": args.override,
                }
            path.write_text(json.dumps(results, indent=1) + "\n")

        done(None, [])  # the toolkit's figures and the plan, before the first model
        runs = benchmark_models(ctx, models, settings, args, workdir, done)

    results = json.loads(path.read_text())
    render(results, args.out, args.update_readme)
    print()
    print((args.out / "results.md").read_text())
    print(
        f"total {results['total_seconds']:.0f} s; wrote {args.out}/results.json, "
        "results.md, ratios.png" + (", README.md" if args.update_readme else "")
    )
    failed = any("error" in r for r in [*runs, *models.values()])
    print(f"{len(models)} model(s) run, {len(results['models'])} in {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
