"""benchmarks/results.json is merged per model and the README's benchmark section is
rendered from it (engine-free: hand-made runs, no vLLM engine)."""

from __future__ import annotations

import copy
import json

import pytest

from conftest import REPO, script

bench = script("benchmark")

SETTINGS = {
    "preset": "cpu",
    "dtype": "float32",
    "eager": True,
    "repeats": 2,
    "sizes": {"hidden_size": 512},
    "throughput": {"requests": 16, "prompt": 256, "output": 16},
    "latency": {"requests": 3, "prompt": 128, "output": 32},
}
MACHINE = {
    "cpu": "AMD EPYC",
    "cpus_usable": 2,
    "device": "cpu",
    "gpu": None,
    "torch": "2",
    "vllm": "0.32.0",
    "transformers": "5.19.0",
}


def run(model, impl, repeat, tok_s, **extra):
    return {
        "model": model,
        "impl": impl,
        "repeat": repeat,
        "throughput_tok_s": tok_s,
        "ttft_ms": 10.0,
        "itl_ms": 5.0,
        "startup_s": 3.0,
        **extra,
    }


def results(date, models, runs, settings=SETTINGS):
    summary, ratios = bench.summarize(runs, models)
    return {
        "date": date,
        "machine": MACHINE,
        "settings": settings,
        "models": models,
        "runs": runs,
        "summary": summary,
        "ratios": ratios,
        "toolkit": {"old": True},
    }


OLD = results(
    "2026-11-30",
    {"llama": {"native_class": "x:Llama"}, "qwen3": {"native_class": "x:Qwen3"}},
    [
        run(m, impl, rep, tok)
        for m in ("llama", "qwen3")
        for rep in (1, 2)
        for impl, tok in (("generated", 100.0), ("native", 100.0))
    ],
)


def test_a_run_replaces_its_models_rows_and_keeps_the_others():
    new = results(
        "2026-12-06",
        {"qwen3": {"native_class": "x:Qwen3", "date": "2026-12-06"}},
        [run("qwen3", "generated", 1, 150.0), run("qwen3", "native", 1, 100.0)],
    )
    new["toolkit"] = None  # not timed this run: the last figures stay
    out = bench.merged(copy.deepcopy(OLD), new)
    assert sorted(out["models"]) == ["llama", "qwen3"]
    assert out["models"]["llama"]["date"] == "2026-11-30"
    assert [r["throughput_tok_s"] for r in out["runs"] if r["model"] == "qwen3"] == [
        150.0,
        100.0,
    ]
    assert len([r for r in out["runs"] if r["model"] == "llama"]) == 4
    ratio = out["ratios"]["qwen3"]["vs_native"]["throughput_tok_s"]
    assert ratio["median"] == pytest.approx(1.5) and ratio["n"] == 1
    assert out["ratios"]["llama"]["vs_native"]["throughput_tok_s"]["n"] == 2
    assert out["toolkit"] == {"old": True}
    assert "2026-11-30 to 2026-12-06" in bench.machine_line(out)


def test_results_under_other_settings_are_not_merged():
    quick = {**SETTINGS, "preset": "quick", "sizes": {"hidden_size": 256}}
    new = results("2026-12-06", {"qwen3": {}}, [], settings=quick)
    assert sorted(bench.merged(copy.deepcopy(OLD), new)["models"]) == ["qwen3"]


def test_rows_from_another_cpu_are_kept_and_name_it():
    """Each ratio is measured side by side within one run, so a row from an earlier run
    on another CPU stays, named; another kind of device starts afresh."""
    new = results("2026-12-06", {"qwen3": {"native_class": "x:Qwen3"}}, [])
    new["machine"] = {**MACHINE, "cpu": "Intel Xeon"}
    out = bench.merged(copy.deepcopy(OLD), new)
    assert sorted(out["models"]) == ["llama", "qwen3"]
    assert out["models"]["llama"]["machine"] == "AMD EPYC"
    rows = bench.ratio_table(out, "native")
    assert any(r.startswith("| llama (on AMD EPYC) ") for r in rows), rows
    assert any(r.startswith("| qwen3 |") for r in rows), rows
    assert "rows marked (on ...) were measured on that CPU" in bench.machine_line(out)
    gpu = copy.deepcopy(new)
    gpu["machine"] = {**MACHINE, "device": "cuda", "gpu": "H100"}
    assert sorted(bench.merged(copy.deepcopy(OLD), gpu)["models"]) == ["qwen3"]


def test_every_model_has_a_row_saying_why_it_is_not_compared():
    models = {
        "bloom": {"native_class": "x:Bloom"},
        "phi": {"native_class": None},
        "broken": {"native_class": None, "error": "checkpoint: ValueError: no"},
    }
    runs = [
        run("bloom", "generated", 1, 100.0),
        run("bloom", "native", 1, 90.0),
        {
            "model": "bloom",
            "impl": "transformers",
            "repeat": 1,
            "error": "ValidationError: 1 validation error for ModelConfig\n  Value "
            "error, The Transformers implementation of 'BloomForCausalLM' is not "
            "compatible with vLLM. [type=value_error, input_value=ArgsKwargs(())]",
        },
        run("phi", "generated", 1, 100.0),
        run("phi", "transformers", 1, 50.0),
    ]
    res = results("2026-12-06", models, runs)
    native = "\n".join(bench.ratio_table(res, "native"))
    backend = "\n".join(bench.ratio_table(res, "transformers"))
    assert "| phi | - | - | - | - | no native class |" in native
    assert "| bloom | 1.11x" in native
    assert (
        "| bloom | - | - | - | - | backend cannot serve it: The Transformers "
        "implementation of 'BloomForCausalLM' is not compatible with vLLM. |" in backend
    )
    assert "| phi | 2.00x" in backend
    assert "not run: checkpoint: ValueError: no" in backend


def test_a_row_measured_on_another_file_says_so():
    committed = bench.current_sha("qwen3")
    assert committed
    assert bench.model_cell("qwen3", {"file_sha256": committed}) == "qwen3"
    assert bench.model_cell(
        "qwen3", {"file_sha256": "0" * 64, "date": "2026-11-30"}
    ) == ("qwen3 (ran 2026-11-30 on an earlier file)")


def test_resume_without_an_interrupted_run_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps(OLD))
    assert bench.main(["--resume", "--out", str(tmp_path)]) == 2
    assert "no interrupted run to resume" in capsys.readouterr().err


def test_the_readme_section_is_rendered_from_the_committed_results():
    committed = json.loads((REPO / "benchmarks" / "results.json").read_text())
    assert "in_progress" not in committed, "an interrupted run: --resume it"
    readme = (REPO / "README.md").read_text()
    section = readme.split(bench.README_START, 1)[1].split(bench.README_END, 1)[0]
    assert (
        section.strip()
        == bench.readme_section(committed, REPO / "benchmarks" / "ratios.png").strip()
    ), "rerender: python scripts/benchmark.py --render-only --update-readme"
    default = set(bench.DEFAULT_MODELS)
    assert default <= set(committed["models"]), sorted(
        default - set(committed["models"])
    )


def test_a_row_built_with_an_override_names_it():
    assert bench.parse_overrides(["num_key_value_heads=4", 'x="a=b"']) == {
        "num_key_value_heads": 4,
        "x": "a=b",
    }
    committed = bench.current_sha("qwen3")
    cell = bench.model_cell(
        "qwen3", {"file_sha256": committed, "overrides": {"num_key_value_heads": 4}}
    )
    assert cell == "qwen3 (num_key_value_heads=4)"


def test_a_hybrid_benchmark_checkpoint_builds_every_layer_kind():
    """LFM2's config defaults to attention on every layer: the benchmark mixes its
    short-convolution layers in as verify's tiny config does, over its own depth (a
    benchmark of the default would time no ShortConv at all)."""
    kinds = bench.every_layer_kind("transformers/models/lfm2/modeling_lfm2.py", 6)
    assert list(kinds) == ["layer_types"]
    assert len(kinds["layer_types"]) == 6
    assert set(kinds["layer_types"]) == {"conv", "full_attention"}


def test_the_lfm2_row_was_measured_with_its_short_convolutions():
    results = json.loads((REPO / "benchmarks" / "results.json").read_text())
    config = results["models"]["lfm2"]["checkpoint"]["config"]
    assert "conv" in config["layer_types"], config
