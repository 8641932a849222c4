"""COVERAGE.md is true of main: each committed generated file's report lines are its
coverage row's, and a row that records what it ran on names the committed file's
sha256 and its source's (engine-free; `scripts/coverage.py --stale` reruns the rows
this finds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, coverage_script

from codemods.check import sha as sha256
from codemods.source import resolve

MANIFEST = json.loads((REPO / "generated" / "manifest.json").read_text())
ROWS = {
    r["file"]: r
    for r in json.loads((REPO / "benchmarks" / "coverage.json").read_text())["rows"]
}


def report_lines(text: str) -> dict[str, list[str]]:
    """The header's `Fused:` / `Unfused:` / `Kept:` / `Refused:` lines, in order."""
    header = text.split('"""', 1)[0]
    lines = [
        ln[len("#   ") :].strip() for ln in header.splitlines() if ln.startswith("#   ")
    ]
    return {
        key: [ln for ln in lines if ln.startswith(prefix)]
        for key, prefix in (
            ("fused", "Fused: "),
            ("unfused", "Unfused: "),
            ("kept", "Kept: "),
            ("refusals", "Refused: "),
        )
    }


def stale(model: str, text: str) -> list[str]:
    """What the coverage row says that the committed file `text` does not."""
    source = Path(MANIFEST[model]["source"]).name
    row = ROWS.get(source)
    if row is None:
        return [f"no row for {source}"]
    out = []
    if row.get("status") != "verified":
        out.append(f"row status {row.get('status')!r}, but the file is committed")
    for key, lines in report_lines(text).items():
        if (row.get(key) or []) != lines:
            out.append(f"{key}: row {len(row.get(key) or [])}, file {len(lines)}")
    recorded = row.get("ran_on")
    if recorded:
        if recorded["output_sha256"] != sha256(text):
            out.append("the file's sha256 is not the one the row was verified on")
        if recorded["source_sha256"] != sha256(resolve(source).read_text()):
            out.append("the source changed since the row")
    return out


@pytest.mark.parametrize("model", sorted(MANIFEST))
def test_each_committed_file_is_its_coverage_row(model):
    text = (REPO / "generated" / f"{model}.py").read_text()
    assert (
        stale(model, text) == []
    ), f"{model}: rerun its row: python scripts/coverage.py --stale"


def test_a_hand_edit_or_a_lost_fusion_is_caught():
    """Able-to-fail, on a file whose row records its sha256: one changed character in
    the body, and one fused part's report line gone."""
    recorded = [
        m
        for m in sorted(MANIFEST)
        if ROWS.get(Path(MANIFEST[m]["source"]).name, {}).get("ran_on")
    ]
    assert recorded, "no committed file's row records what it ran on"
    model = recorded[0]
    text = (REPO / "generated" / f"{model}.py").read_text()
    assert stale(model, text) == []
    edited = text.replace("return hidden_states", "return hidden_states * 1.0", 1)
    assert edited != text
    assert stale(model, edited) == [
        "the file's sha256 is not the one the row was verified on"
    ]
    fused = report_lines(text)["fused"][0]
    lost = text.replace(f"#   {fused}\n", "", 1)
    assert any(line.startswith("fused: ") for line in stale(model, lost))


def test_the_fingerprint_names_what_changed():
    coverage = coverage_script()
    then = {
        "source_sha256": "a",
        "output_sha256": "b",
        "transformers": "5.19.0",
        "vllm": "0.32.0",
    }
    assert coverage.why_stale({"ran_on": then}, dict(then)) is None
    assert coverage.why_stale({}, then) == "no record of what it ran on"
    assert coverage.why_stale({"ran_on": then}, {**then, "output_sha256": "c"}) == (
        "generated output or refusal changed"
    )
    assert coverage.why_stale({"ran_on": then}, {**then, "vllm": "0.33.0"}) == (
        "vLLM version changed"
    )


def test_the_readme_table_is_the_coverage_rows_of_every_committed_file():
    coverage = coverage_script()
    readme = (REPO / "README.md").read_text()
    block = readme.split(coverage.MODELS_START + "\n", 1)[1].split(coverage.MODELS_END)[
        0
    ]
    assert block == coverage.models_table(list(ROWS.values()))
    listed = [line for line in block.splitlines()[2:] if line.startswith("| [`")]
    assert len(listed) == len(MANIFEST)


def test_every_verified_row_has_its_file_committed():
    """generated/ is the library a user browses: a verified row names a committed file
    (and so falls under the staleness test above)."""
    committed = {Path(entry["source"]).name for entry in MANIFEST.values()}
    verified = {f for f, r in ROWS.items() if r.get("status") == "verified"}
    assert verified and verified <= committed, sorted(verified - committed)
