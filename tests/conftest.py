"""Shared fixtures: a tiny Qwen3 checkpoint, its transformers model, and an engine-free
vLLM instance of the generated class loaded from the same safetensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# every CPU runs vLLM's non-AMX kernels (see generated.NO_AMX): the engines the tests
# start inherit it, so CI's machine and this one take the same path
os.environ.setdefault("CODEMODS_NO_AMX", "1")
# `make test` runs a sample of the largest engine suites (mutants, able-to-fail copies);
# scripts/engine_sweep.py sets this to run every case, before an issue is resolved
FULL_SWEEP = os.environ.get("CODEMODS_SWEEP") == "1"


# Tests that start vLLM engines or spawn tensor-parallel ranks run on one xdist worker,
# one at a time (`make test`: `pytest -n 2 --dist loadgroup`); the engine-free tests
# share the other worker and this one's idle time.
SPAWNS_RANKS = {"test_tp_weights", "test_faithful_tp_weights"}


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("engine") or item.module.__name__ in SPAWNS_RANKS:
            item.add_marker(pytest.mark.xdist_group("engine"))
            if getattr(config.option, "loadgroup", False) and "@" not in item.nodeid:
                _in_group(item, "engine")


def _in_group(item, group: str) -> None:
    """What xdist's `loadgroup` does to a marked item's id (`<id>@<group>`, one worker
    per group): pytest-xdist 3.8 sets `item._nodeid`, which pytest 9 no longer reads (its
    ids are structured), so the engine tests ran on both workers at once and a module's
    fixtures were built on each (the mutation suite's 25 generations, twice)."""
    suffixed = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):  # pytest >= 9
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(suffixed)
    else:
        item._nodeid = suffixed


def run_cli(
    *args: str, cwd: Path = REPO, timeout: int = 900
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def load_on_rank(model_cls, ckpt: str, rank: int, port: int, tp: int):
    """In a rank's own process: `model_cls` (a generated causal LM) built on rank `rank`
    of `tp` tensor-parallel ranks (gloo over 127.0.0.1:`port`), the checkpoint loaded
    through its own `load_weights`, before process_weights_after_loading (which repacks
    CPU weights)."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.torch_utils import set_default_torch_dtype

    os.environ["VLLM_DIST_IDENT"] = str(port)
    cfg = EngineArgs(
        model=ckpt,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
        hf_overrides={"architectures": [f"Generated{model_cls.__name__}"]},
    ).create_engine_config()
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=tp,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        initialize_model_parallel(tp, 1)
        with set_default_torch_dtype(torch.float32):
            model = model_cls(vllm_config=cfg)
        weights = load_file(f"{ckpt}/model.safetensors")
        model.load_weights(iter(weights.items()))
    return model, weights


def verify_in_one_process(
    targets: list[str], timeout: int = 1800, retry: bool = True
) -> list[dict]:
    """`verify` each target (a model type or a generated file) in one fresh process, one
    engine at a time; its JSON result with the exit code under "code", in order."""
    script = textwrap.dedent(f"""
        import json
        from codemods.verify import _safe_verify
        for target in {targets!r}:
            code, result = _safe_verify(target)
            print("RESULT " + json.dumps({{"code": code, **result}}), flush=True)
        """)
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results = [
        json.loads(line[len("RESULT ") :])
        for line in run.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    assert len(results) == len(targets), run.stderr[-3000:]
    # vLLM 0.32 can lose its process groups after many engines in one process (the
    # coverage harness sees the same); such a file gets one fresh process, any other
    # failure stands
    lost = [
        i
        for i, r in enumerate(results)
        if r["code"] == 2 and LOST_GROUP in str(r.get("error"))
    ]
    if lost and retry:
        again = verify_in_one_process([targets[i] for i in lost], timeout, retry=False)
        for i, r in zip(lost, again):
            results[i] = r
    return results


LOST_GROUP = "pipeline model parallel group is not initialized"


def script(name: str):
    """scripts/<name>.py, loaded as a module (a script, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"script_{name}", REPO / "scripts" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def coverage_script():
    return script("coverage")


def edited_modeling_file(tmp_path: Path, name: str, old: str, new: str) -> Path:
    """A copy of an installed transformers modeling file with `old` (once) -> `new`."""
    from codemods.source import resolve

    text = resolve(name).read_text()
    assert text.count(old) == 1, old
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return path


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory):
    """(directory, transformers model) of a tiny random Qwen3 with its features on."""
    from transformers import Qwen3ForCausalLM

    from codemods import tiny

    out = tmp_path_factory.mktemp("qwen3-tiny")
    config = tiny.tiny_config(Qwen3ForCausalLM.config_class)
    model = tiny.build_checkpoint(Qwen3ForCausalLM, config, out)
    model.config._attn_implementation = "eager"
    return out, model


@pytest.fixture(scope="session")
def vllm_engine_free(qwen3_checkpoint, tmp_path_factory):
    """A vLLM config with a single-rank process group, for building models directly."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    ckpt, _ = qwen3_checkpoint
    cfg = EngineArgs(
        model=str(ckpt),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        hf_overrides={"architectures": ["GeneratedQwen3ForCausalLM"]},
    ).create_engine_config()
    init_file = tmp_path_factory.mktemp("dist") / "init"
    with set_current_vllm_config(cfg):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"file://{init_file}",
            backend="gloo",
        )
    # without a model config vLLM makes the expert-parallel group too, which the native
    # MoE classes ask for when built (a dense model's config would skip it)
    with set_current_vllm_config(VllmConfig()):
        initialize_model_parallel(1, 1)
    with set_current_vllm_config(cfg):
        yield cfg


def build_loaded(model_cls, cfg, ckpt: Path, process: bool = True):
    """Construct `model_cls` under `cfg`, load the checkpoint's safetensors through its
    own `load_weights`, and post-process the weights as the engine does."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    # Attention layers register by name; these tests build several models, never run them
    cfg.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(cfg), set_default_torch_dtype(torch.float32):
        model = model_cls(vllm_config=cfg)
        weights = load_file(ckpt / "model.safetensors")
        loaded = model.load_weights(iter(weights.items()))
        if process:
            process_weights_after_loading(model, cfg.model_config, torch.device("cpu"))
    return model, loaded, weights
