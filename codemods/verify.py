"""`python -m codemods.verify <arch | generated file>`: the generated model in real vLLM
against transformers on the same tiny random checkpoint.

Exit 0 when it matches (the generated class ran, greedy tokens identical, logprobs
within 1e-4 in fp32), 1 when it ran and differs, 2 when it could not generate or run.
The last line printed is one JSON object (with `--all`, a table, then one JSON object
per model).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import reduced_precision
from .errors import CodemodError, error_line

GENERATED = Path(__file__).resolve().parent.parent / "generated"
TOLERANCE = 1e-4
MAX_TOKENS = 8
PROMPT_LENGTHS = (5, 13, 29, 47)


def read_header(path: Path) -> dict[str, str]:
    try:
        head = path.read_text(encoding="utf-8")[:8192]
    except (OSError, UnicodeDecodeError) as exc:
        raise CodemodError(f"{path}: cannot read: {exc}") from None
    fields = dict(re.findall(r"^# (source|architecture):\s+(.+)$", head, re.MULTILINE))
    if (
        "source" not in fields
        or "architecture" not in fields
        or "->" not in fields["architecture"]
    ):
        raise CodemodError(
            f"{path}: not a generated file (its header names no source/architecture)"
        )
    fields["fused"] = str(len(re.findall(r"^#\s+Fused: ", head, re.MULTILINE)))
    fields["refused"] = str(len(re.findall(r"^#\s+Refused: ", head, re.MULTILINE)))
    fields["unfused"] = str(len(re.findall(r"^#\s+Unfused: ", head, re.MULTILINE)))
    cpu_dtype = re.search(r"^# cpu dtype:\s+(\w+)", head, re.MULTILINE)
    fields["cpu_dtype"] = cpu_dtype.group(1) if cpu_dtype else None
    fields["environment"] = dict(
        re.findall(r"^# environment:\s+(\w+)=(\S+)", head, re.MULTILINE)
    )
    # the file serves one pipeline stage only (its report says why)
    no_pipeline = re.search(
        r"^#\s+Unfused: pipeline parallel \(\w+\): not supported: (.+)$",
        head,
        re.MULTILINE,
    )
    fields["no_pipeline"] = no_pipeline.group(1) if no_pipeline else None
    return fields


def generated_models() -> list[str]:
    return sorted(p.stem for p in GENERATED.glob("*.py") if not p.name.startswith("_"))


def resolve_target(target: str) -> Path:
    path = Path(target)
    if path.suffix == ".py":
        if not path.exists():
            raise CodemodError(f"{target}: no such file")
        return path
    path = GENERATED / f"{target}.py"
    if not path.exists():
        raise CodemodError(
            f"{target}: no generated model of that name (have: {', '.join(generated_models())})"
        )
    return path


def reference_class(source: str, class_name: str, trust_remote_code: bool):
    """The transformers class the generated file was made from, imported from its source."""
    from . import loading
    from .source import load

    if source.startswith("transformers/"):
        return getattr(
            importlib.import_module(source[: -len(".py")].replace("/", ".")), class_name
        )
    return loading.model_classes(load(source), class_name, trust_remote_code)


def is_generated(path: Path) -> bool:
    try:
        read_header(path)
        return True
    except CodemodError:
        return False


def prompts_for(vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS
    ]


def parse_override(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise CodemodError(f"--override {text!r}: expected key=value")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        raise CodemodError(
            f"--override {text!r}: the value is not JSON (strings need quotes)"
        ) from None


def load_config_json(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CodemodError(f"--config {path}: {exc}") from None


def verify(
    target: str,
    tp: int = 1,
    pp: int = 1,
    overrides: dict | None = None,
    config_json: dict | None = None,
    trust_remote_code: bool = False,
    layout: str = "saved",
    expert_parallel: bool = False,
    backend: bool = False,
    progress=None,
    dtype: str | None = None,
) -> dict:
    """Verify a generated model, or a modeling file (generated into a temporary folder
    and compared against that same file's model). `progress`, if given, is called with
    each step's description as it starts (see `console.Progress`)."""
    progress = progress or _no_progress
    options = dict(
        tp=tp,
        pp=pp,
        overrides=overrides,
        config_json=config_json,
        trust_remote_code=trust_remote_code,
        layout=layout,
        expert_parallel=expert_parallel,
        backend=backend,
        progress=progress,
        dtype=dtype,
    )
    path = resolve_target(target)
    steps = 4 + bool(backend)
    if is_generated(path):
        progress.total = steps
        return _verify_generated(path, **options)
    from .apply import generate, output_path

    progress.total = steps + 1
    progress(f"generate: {path.name} -> a temporary generated file")
    model_plan, text = generate(str(path), trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="verify-source-") as tmp:
        out = output_path(model_plan, Path(tmp))
        out.write_text(text, encoding="utf-8")
        return _verify_generated(out, **options)


def _verify_generated(
    path: Path,
    tp,
    pp,
    overrides,
    config_json,
    trust_remote_code,
    layout,
    expert_parallel,
    backend=False,
    progress=None,
    dtype=None,
) -> dict:
    from . import registration

    header = read_header(path)
    if pp > 1 and header["no_pipeline"]:
        raise CodemodError(
            f"{path.stem}: pipeline parallel is not supported by this file: "
            f"{header['no_pipeline']}"
        )
    dtype = dtype or _engine_dtype(header)
    for key, value in header.get("environment", {}).items():
        os.environ[key] = value  # what the file says vLLM must run it with
    arch, causal_name = (s.strip() for s in header["architecture"].split("->"))
    causal_cls = reference_class(
        header["source"].strip(), causal_name, trust_remote_code
    )
    configs = tiny_configs(
        header["source"].strip(),
        causal_cls,
        overrides,
        config_json,
        tp,
        pp,
        trust_remote_code,
    )
    result = {
        "arch": path.stem,
        "impl": None,
        "tp": tp,
        "pp": pp,
        "features": configs[0].features,
        "kinds": sorted(set().union(*(c.kinds for c in configs))),
        "layer_types": _layer_types(configs),
        "tiny_configs": len(configs),
        "fused": int(header["fused"]),
        "refused": int(header["refused"]),
        "unfused": int(header["unfused"]),
    }
    if dtype != "float32":
        result["dtype"] = dtype
    if overrides:  # as the checkpoint's config holds them
        result["overrides"] = {
            k: getattr(configs[0].config, k, None) for k in sorted(overrides)
        }
    if len(configs) > 1:
        progress.total += 4 * (len(configs) - 1)
    if layout != "saved":
        result["layout"] = layout
    if expert_parallel:
        result["expert_parallel"] = True
    adjusted = [n for c in configs for n in c.adjusted]
    if adjusted:
        result["adjusted"] = list(dict.fromkeys(adjusted))
        for note in result["adjusted"]:
            progress.note(note)
    expected_module = f"generated.{path.stem}"
    text = path.read_text(encoding="utf-8")
    # vLLM's chunked local attention needs its chunk to be whole KV-cache blocks
    block_size = 32 if "ChunkedLocalAttention(" in text else None
    unbuilt = unbuilt_prefixes(text)
    runs = []
    with tempfile.TemporaryDirectory(prefix=f"verify-{path.stem}-") as tmp:
        if path.resolve().parent != GENERATED:
            plugin_dir = Path(tmp) / "plugin"
            plugin_dir.mkdir()
            arch, expected_module = registration.register_external(
                path, causal_name, plugin_dir
            )
        for i, tiny_config in enumerate(configs):
            runs.append(
                _run_one(
                    tiny_config,
                    causal_cls,
                    arch,
                    Path(tmp) / f"checkpoint-{i}",
                    layout,
                    tp,
                    pp,
                    expert_parallel,
                    # the backend decorates transformers' classes in place (vLLM's
                    # compile wrapper), so it runs once, after every reference is built
                    backend and i == len(configs) - 1,
                    block_size,
                    progress,
                    f" (config {i + 1} of {len(configs)})" if len(configs) > 1 else "",
                    dtype,
                    unbuilt,
                )
            )
    worst = max(runs, key=lambda r: (not r["ok_numbers"], r["max_abs_logprob_diff"]))
    if dtype != "float32":
        result["tolerance"] = worst["tolerance"]
        for key in ("noise_floor", "noise_mean", "mean_abs_logprob_diff"):
            result[key] = worst[key]
    generated_ran = all(r["impl"].startswith(f"{expected_module}:") for r in runs)
    result.update(
        impl=worst["impl"],
        max_abs_logprob_diff=worst["max_abs_logprob_diff"],
        tokens_equal=all(r["tokens_equal"] for r in runs),
        ok=bool(generated_ran and all(r["ok_numbers"] for r in runs)),
    )
    if len(configs) > 1:
        result["configs"] = [
            {
                "kinds": sorted(c.kinds),
                "changed": c.changed,
                "max_abs_logprob_diff": r["max_abs_logprob_diff"],
                "tokens_equal": r["tokens_equal"],
            }
            for c, r in zip(configs, runs)
        ]
    if "exact" in worst:
        result["exact"] = worst["exact"]
    if backend:
        result["backend"] = runs[-1]["backend"]
    shares = [r["rank_share"] for r in runs if "rank_share" in r]
    if shares:
        result["rank_share"] = max(shares)
    if not generated_ran:
        bad = next(
            r["impl"] for r in runs if not r["impl"].startswith(f"{expected_module}:")
        )
        result["error"] = f"vLLM ran {bad}, not the generated class"
    return result


def _engine_dtype(header: dict) -> str:
    """fp32, or the one dtype the file's header says vLLM's CPU build runs it in (on a
    CPU; a GPU runs it in fp32)."""
    if not header.get("cpu_dtype"):
        return "float32"
    from vllm.platforms import current_platform

    return header["cpu_dtype"] if current_platform.is_cpu() else "float32"


def _layer_types(configs) -> dict[str, list[str]]:
    """{per-layer list of the configs: the distinct values their layers take}."""
    out: dict[str, set] = {}
    for c in configs:
        n = getattr(c.config, "num_hidden_layers", None)
        for key, value in c.config.to_dict().items():
            if (
                isinstance(value, list)
                and len(value) == n
                and value
                and all(isinstance(v, str) for v in value)
            ):
                out.setdefault(key, set()).update(value)
    return {k: sorted(v) for k, v in sorted(out.items())}


@dataclass
class TinyConfig:
    """One tiny checkpoint verify runs: its config, the published config.json it came
    from (`--config`), what was fitted for the ranks, the layer kinds it builds."""

    config: object
    raw: dict | None
    adjusted: list[str]
    kinds: set[str]
    features: list[str]
    changed: dict  # what this config sets beyond the first one


def tiny_configs(
    source: str, causal_cls, overrides, config_json, tp, pp, trust_remote_code
) -> list[TinyConfig]:
    """The tiny configs to verify: a published config shrunk (`--config`), the tiny
    values with `--override`s, or else every config `layer_kinds.cover` needs to build
    each kind of layer the source can build."""
    from . import layer_kinds, probe, tiny

    config_cls = causal_cls.config_class
    if config_json is not None:
        raw = tiny.shrink(config_json, overrides)
        adjusted = tiny.fit_parallel(raw, tp, pp)
        config = config_cls.from_dict(raw)
        return [_tiny(causal_cls, raw, config, raw, adjusted, {})]
    try:
        values = tiny.working_values(causal_cls, overrides)
    except Exception as exc:  # the source's own model fails: say so in one line
        raise CodemodError(
            f"cannot build a tiny {causal_cls.__name__} from the source: "
            f"{type(exc).__name__}: {probe.one_line(exc)}"
        ) from None
    variants = [values]
    if not overrides:  # what the user set is what runs
        from .loading import load_module
        from .source import load

        src = load(Path(source).name if source.startswith("transformers/") else source)
        load_module(src, trust_remote_code)
        variants = layer_kinds.cover(
            causal_cls, src.module, src.classes, values
        ).variants
    out = []
    for v in variants:
        v = json.loads(json.dumps(v))
        adjusted = tiny.fit_parallel(v, tp, pp)
        changed = {k: x for k, x in v.items() if variants[0].get(k) != x}
        out.append(_tiny(causal_cls, v, config_cls(**v), None, adjusted, changed))
    return out


def _tiny(causal_cls, values, config, raw, adjusted, changed) -> TinyConfig:
    from . import layer_kinds, tiny

    built = layer_kinds.built_classes(causal_cls, values) or set()
    module = causal_cls.__module__
    kinds = {
        n
        for n in built
        if getattr(getattr(importlib.import_module(module), n, None), "__module__", "")
        == module
    }
    return TinyConfig(config, raw, adjusted, kinds, tiny.features_on(config), changed)


def unbuilt_prefixes(text: str) -> tuple[str, ...]:
    """The checkpoint prefixes a generated file's loader ignores: modules it does not
    build (`assembly.constant_arguments`), left out of what a rank's share counts."""
    import ast

    found = re.search(r"ignore_unexpected_prefixes=(\[[^\]]*\])", text)
    return tuple(ast.literal_eval(found.group(1))) if found else ()


def _run_one(
    tc: TinyConfig,
    causal_cls,
    arch,
    ckpt,
    layout,
    tp,
    pp,
    expert_parallel,
    backend,
    block_size,
    progress,
    label,
    dtype="float32",
    unbuilt: tuple[str, ...] = (),
) -> dict:
    """One tiny checkpoint: transformers' greedy reference against the engine's (in
    `dtype` where the file's CPU kernels take no other: see `reduced_precision`)."""
    import torch

    from . import engine, exact_reference, reference, tiny

    reduced = dtype != "float32"
    progress(
        f"checkpoint{label}: tiny random {causal_cls.__name__} ({layout} names), safetensors"
        + (f"; features on: {', '.join(tc.features)}" if tc.features else "")
    )
    model = tiny.build_checkpoint(
        causal_cls,
        tc.config,
        ckpt,
        raw_config=tc.raw,
        layout=layout,
        rounded_to=getattr(torch, dtype) if reduced else None,
    )
    prompts = prompts_for(model.config.vocab_size)
    progress(
        f"reference{label}: transformers, greedy, {len(prompts)} prompts x {MAX_TOKENS} tokens"
    )
    ref = reference.greedy_with_logprobs(model, prompts, MAX_TOKENS)
    tolerance, out = TOLERANCE, {}
    if reduced:
        progress(f"noise floor{label}: transformers in {dtype} against itself in fp32")
        floor = reduced_precision.noise_floor(
            model, dtype, prompts, ref, MAX_TOKENS, path_diffs
        )
        tolerance = floor.tolerance
        out.update(noise_floor=floor.max, noise_mean=floor.mean, tolerance=tolerance)
    whole = engine.body_bytes(model, unbuilt)
    del model
    progress(f"engine{label}: real vLLM, {arch}, TP={tp} PP={pp}")
    ran = engine.run(
        str(ckpt),
        arch,
        prompts,
        MAX_TOKENS,
        tp=tp,
        pp=pp,
        expert_parallel=expert_parallel,
        block_size=block_size,
        dtype=dtype,
    )
    progress(f"compare{label}: tokens equal, logprobs within {tolerance:g}")
    diffs, tokens_equal = path_diffs(prompts, ref, ran)
    max_diff = max(diffs) if diffs else float("inf")
    if pp == 1 and ran.rank_bytes and whole:
        # what the largest rank holds of the transformers model's parameters outside
        # the embeddings and head: ~1/tp where every layer is sharded, 1.0 replicated
        out["rank_share"] = round(max(ran.rank_bytes) / whole, 3)
    ok_numbers = bool(tokens_equal and max_diff <= TOLERANCE)
    if reduced:
        gaps = reduced_precision.tie_gaps(prompts, ref, ran)
        out.update(tie_gaps=gaps, mean_abs_logprob_diff=sum(diffs) / len(diffs))
        ok_numbers = reduced_precision.holds(floor, diffs, gaps)
    elif tokens_equal and not ok_numbers:
        # an ill-conditioned tiny model: is vLLM as close to the exact run as
        # transformers' own fp32 run is?
        exact = exact_reference.compare_to_exact(
            causal_cls, ckpt, prompts, ref, ran, MAX_TOKENS, compare
        )
        if exact is not None:
            out["exact"] = {
                "to_exact": exact.to_exact,
                "reference_error": exact.reference_error,
            }
            ok_numbers = exact.holds(TOLERANCE)
    if backend:
        # last: the backend patches transformers' classes in this process
        progress(f"backend{label}: vLLM's Transformers backend, same checkpoint")
        out["backend"] = _backend(
            str(ckpt), causal_cls.__name__, prompts, ref, tp, pp, block_size
        )
    out.update(
        impl=ran.impl,
        max_abs_logprob_diff=max_diff,
        tokens_equal=tokens_equal,
        ok_numbers=ok_numbers,
    )
    return out


class _NoProgress:
    total = 0

    def __call__(self, what: str) -> None:
        pass

    def note(self, text: str) -> None:
        print(f"note: {text}", file=sys.stderr)


_no_progress = _NoProgress()

BACKEND_MODULE = "vllm.model_executor.models.transformers"


def backend_only(name: str, trust_remote_code: bool = False) -> dict:
    """vLLM's Transformers backend alone on the tiny checkpoint verify would build for
    `name`'s causal LM (its first tiny config), against transformers: what a user of
    the backend gets where this toolkit generates nothing (a refused file)."""
    import torch

    from . import loading, reference, roles, tiny
    from .source import load

    source = load(name)
    pymodule = loading.load_module(source, trust_remote_code)
    causal_cls = roles.causal_class(pymodule, source.classes, source)
    config = tiny_configs(name, causal_cls, {}, None, 1, 1, trust_remote_code)[0]
    with tempfile.TemporaryDirectory(prefix="backend-") as tmp:
        model = tiny.build_checkpoint(
            causal_cls, config.config, Path(tmp), raw_config=config.raw, layout="saved"
        )
        prompts = prompts_for(model.config.vocab_size)
        with torch.no_grad():
            ref = reference.greedy_with_logprobs(model, prompts, MAX_TOKENS)
        del model
        return _backend(tmp, causal_cls.__name__, prompts, ref, 1, 1)


def _backend(
    ckpt: str, arch: str, prompts, ref, tp: int, pp: int, block_size=None
) -> dict:
    """vLLM's Transformers backend on the same checkpoint, for comparison."""
    from . import engine

    try:
        ran = engine.run(
            ckpt,
            arch,
            prompts,
            MAX_TOKENS,
            tp=tp,
            pp=pp,
            model_impl="transformers",
            block_size=block_size,
        )
    except Exception as exc:  # the backend cannot serve it: say why, in one line
        why = error_line(str(exc))
        return {"ok": False, "error": f"{type(exc).__name__}: {why}"[:300]}
    max_diff, tokens_equal = compare(prompts, ref, ran)
    ran_backend = ran.impl.startswith(BACKEND_MODULE)
    out = {
        "impl": ran.impl,
        "max_abs_logprob_diff": max_diff,
        "tokens_equal": tokens_equal,
        "ok": bool(ran_backend and tokens_equal and max_diff <= TOLERANCE),
        "fused": ran.fused or [],
    }
    if not ran_backend:
        out["error"] = f"vLLM ran {ran.impl}, not its Transformers backend"
    return out


def safe_backend_only(name: str) -> dict:
    """`backend_only` in a process of its own (the backend patches transformers'
    classes in the process that runs it), or why no tiny checkpoint of the source
    could be built for it."""
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-c", _BACKEND_ONLY, name],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    said = [
        line.removeprefix(_FAILED)
        for line in proc.stderr.splitlines()
        if line.startswith(_FAILED)
    ]
    why = said[-1] if said else error_line(proc.stderr.strip() or "no output")
    return {"ok": False, "error": f"no tiny checkpoint: {why}"[:300]}


_FAILED = "backend-only failed: "
# one line of JSON; a failure before the engine (the source's own tiny model) exits 1
# with its message on a line of stderr starting with _FAILED
_BACKEND_ONLY = """
import json, sys
from codemods.errors import error_line
from codemods.logs import quiet_vllm_logging
from codemods.verify import backend_only
quiet_vllm_logging()
try:
    result = backend_only(sys.argv[1])
except Exception as exc:
    sys.stderr.write("\\nbackend-only failed: " + error_line(str(exc)) + "\\n")
    sys.exit(1)
print(json.dumps(result))
"""


def compare(prompts, ref, ran, prompt_positions: bool = True) -> tuple[float, bool]:
    """(max |logprob difference| along the shared greedy path, greedy tokens equal).
    `prompt_positions=False`: `ran` holds the generated positions' logprobs only."""
    diffs, tokens_equal = path_diffs(prompts, ref, ran, prompt_positions)
    return (max(diffs) if diffs else float("inf")), tokens_equal


def path_diffs(prompts, ref, ran, prompt_positions: bool = True):
    """(each |logprob difference| along the shared greedy path, greedy tokens equal)."""
    diffs, tokens_equal = [], True
    for prompt, (ref_tokens, ref_lp), tokens, lps in zip(
        prompts, ref, ran.tokens, ran.logprobs
    ):
        tokens_equal &= ref_tokens == tokens
        seq = prompt + ref_tokens
        want = [
            float(ref_lp[i - 1, seq[i]]) for i in range(1, len(prompt) + len(tokens))
        ]
        # compare as far as both followed the same tokens
        same = next(
            (i for i, (a, b) in enumerate(zip(ref_tokens, tokens)) if a != b),
            len(tokens),
        )
        n = len(prompt) - 1 + same + (1 if same < len(tokens) else 0)
        skip = 0 if prompt_positions else len(prompt) - 1
        diffs += [abs(a - b) for a, b in zip(want[skip:n], lps[: n - skip])]
    return diffs, tokens_equal


def _safe_verify(target: str, **kwargs) -> tuple[int, dict]:
    try:
        result = verify(target, **kwargs)
    except CodemodError as exc:
        return 2, {"arch": target, "ok": False, "error": str(exc)}
    except Exception as exc:  # the engine could not build or run the model
        if os.environ.get("CODEMODS_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return 2, {
            "arch": target,
            "ok": False,
            "error": f"could not run: {type(exc).__name__}: {first}"[:500],
        }
    return (0 if result["ok"] else 1), result


def verdict(r: dict) -> str:
    """One line a person reads: did the generated class run, and how close was it."""
    where = f"TP={r.get('tp', 1)} PP={r.get('pp', 1)}"
    diff = r.get("max_abs_logprob_diff")
    figures = f"max |dlogprob| {diff:.1e}" if isinstance(diff, float) else ""
    exact = r.get("exact")
    if exact:
        figures += (
            f"; against transformers in float64 {exact['to_exact']:.1e}, where "
            f"transformers' own fp32 run is {exact['reference_error']:.1e} from it"
        )
    if r.get("dtype"):
        where += f" in {r['dtype']}"
        factor = reduced_precision.FLOOR_FACTOR
        figures += (
            f", mean {r['mean_abs_logprob_diff']:.1e} (bound: {factor:g}x "
            f"transformers' own {r['dtype']} error, max {r['noise_floor']:.1e}, mean "
            f"{r['noise_mean']:.1e})"
        )
    if r.get("ok"):
        bound = "" if exact or r.get("dtype") else f" <= {TOLERANCE:g}"
        # in a reduced dtype, tokens may split at a near tie of the fp32 reference
        tokens = "equal to" if r.get("tokens_equal") else "split only at near ties of"
        return (
            f"{r['arch']}: OK at {where}: {r['impl']} ran in vLLM; greedy tokens {tokens} "
            f"transformers, {figures}{bound}; parts: {r.get('fused', 0)} fused, "
            f"{r.get('unfused', 0)} unfused, {r.get('refused', 0)} refused"
        )
    if r.get("error"):
        return f"{r['arch']}: FAILED at {where}: {r['error']}"
    return (
        f"{r['arch']}: FAILED at {where}: tokens "
        f"{'equal' if r.get('tokens_equal') else 'differ'}, {figures}"
        + ("" if r.get("dtype") else f" (tolerance {TOLERANCE:g})")
        + f"; {r.get('impl')} ran"
    )


def table(rows: list[dict]) -> str:
    head = (
        "arch",
        "tp",
        "pp",
        "features on",
        "fused",
        "refused",
        "max |dlogprob|",
        "tokens equal",
        "ok",
    )
    lines = [head]
    for r in rows:
        diff = r.get("max_abs_logprob_diff")
        lines.append(
            (
                r["arch"],
                str(r.get("tp", "")),
                str(r.get("pp", "")),
                ", ".join(r.get("features", [])) or "-",
                str(r.get("fused", "")),
                str(r.get("refused", "")),
                f"{diff:.2e}" if isinstance(diff, float) else "-",
                str(r.get("tokens_equal", "-")),
                "ok" if r["ok"] else f"FAIL {r.get('error', '')}".strip(),
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
        for row in lines
    )


def tiny_layouts() -> tuple[str, ...]:
    from .tiny import LAYOUTS

    return LAYOUTS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m codemods.verify", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "target",
        nargs="?",
        help="model type in generated/ (e.g. qwen3) or a generated file's path",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="verify every generated model and print a table",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    parser.add_argument(
        "--config",
        metavar="PATH",
        help="a real checkpoint's config.json: kept, sizes shrunk",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="set a config field (repeatable)",
    )
    parser.add_argument(
        "--ep",
        action="store_true",
        help="expert parallelism: MoE experts split over the --tp ranks (enable_expert_parallel)",
    )
    parser.add_argument(
        "--layout",
        choices=tiny_layouts(),
        default="saved",
        help="checkpoint names: as save_pretrained writes them (published, per-expert "
        "MoE tensors) or the model's in-memory state dict (stacked experts)",
    )
    parser.add_argument(
        "--backend",
        action="store_true",
        help="also run vLLM's Transformers backend on the same checkpoint, for comparison",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="the engine's dtype (default: fp32, or the one the file's header says "
        "vLLM's CPU build runs it in); against transformers in fp32 on bf16-valued "
        "weights, within a measured multiple of transformers' own bf16 error",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow running a modeling file that is not part of the installed transformers",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print only the JSON result on stdout (one object per model)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show vLLM's and transformers' own log (by default kept aside, and its "
        "last lines shown only when a run fails)",
    )
    args = parser.parse_args(argv)
    if bool(args.all) == bool(args.target):
        parser.error("give one model (or a generated file), or --all")
    try:
        overrides = dict(parse_override(o) for o in args.override)
        config_json = load_config_json(args.config) if args.config else None
    except CodemodError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kwargs = {
        "tp": args.tp,
        "pp": args.pp,
        "overrides": overrides,
        "config_json": config_json,
        "trust_remote_code": args.trust_remote_code,
        "layout": args.layout,
        "expert_parallel": args.ep,
        "backend": args.backend,
        "dtype": args.dtype,
    }
    targets = generated_models() if args.all else [args.target]
    results = []
    for target in targets:
        code, result = _run_quietly(target, verbose=args.verbose, **kwargs)
        results.append((code, result))
        if code == 2:  # could not generate or run: one line, the reason
            error = result["error"]
            prefix = "" if error.startswith(result["arch"]) else f"{result['arch']}: "
            print(f"error: {prefix}{error}", file=sys.stderr, flush=True)
        elif not args.json:
            print(verdict(result), flush=True)
    if args.all and not args.json:
        print(table([r for _, r in results]))
    for _, result in results:
        print(json.dumps(result, default=_plain))
    return max(code for code, _ in results)


def _plain(value):
    """A config object in a result (a sub-config an override set) as its fields."""
    to_dict = getattr(value, "to_dict", None)
    return to_dict() if callable(to_dict) else str(value)


# vLLM's engine process says only this when a worker (TP/PP > 1) fails to start; the
# worker's own exception is in the log
ENGINE_START_FAILED = "Engine core initialization failed"
_RAISED = re.compile(r"\b((?:[\w.]+Error|[\w.]+Exception|NotImplementedError): .+)$")


def with_root_cause(error: str, log: str) -> str:
    """`error`, with the exception a worker raised in its place where the engine says
    only that its start failed ("See root cause above", which a one-line error lacks).
    """
    if ENGINE_START_FAILED not in error:
        return error
    raised = [
        found.group(1).strip()
        for line in log.splitlines()
        if "Worker" in line and (found := _RAISED.search(line))
    ]
    if not raised:
        return error
    return f"could not run: {raised[-1]} (in a worker: {ENGINE_START_FAILED.lower()})"


def _run_quietly(target: str, verbose: bool, **kwargs) -> tuple[int, dict]:
    """One verification with its progress lines; vLLM's log only if asked, or its
    tail when the run did not pass."""
    from .console import Progress, captured_output, tail

    label = Path(target).stem if target.endswith(".py") else target
    with captured_output(not verbose) as (stderr, read_log):
        code, result = _safe_verify(
            target, progress=Progress(label, 0, stderr), **kwargs
        )
        log = read_log() if code else ""
    if result.get("error"):
        result["error"] = with_root_cause(result["error"], log)
    if log.strip():
        print(
            f"--- the last lines of vLLM's and transformers' log for {label} "
            "(--verbose shows all of it) ---\n" + tail(log) + "\n---",
            file=sys.stderr,
        )
    return code, result


if __name__ == "__main__":
    sys.exit(main())
