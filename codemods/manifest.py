"""The fusion manifest committed next to the generated files (`generated/manifest.json`).

Per generated model: the source and its hash, the fusions by module class with counts,
and the refusals with their reasons. A regeneration that loses a recorded fusion (a
transformers upgrade that silently stops a match) fails unless explicitly accepted.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .plan import Plan

NAME = "manifest.json"


def entry(model_plan: Plan) -> dict:
    fusions: dict[str, Counter] = {}
    for r in model_plan.records:
        key = f"{' + '.join(r.sources)} -> {r.target} ({r.vllm_class})"
        fusions.setdefault(r.source_class, Counter())[key] += 1
    src = model_plan.source
    return {
        "source": src.display,
        "sha256": src.sha256,
        "fusions": {cls: dict(sorted(c.items())) for cls, c in sorted(fusions.items())},
        "refusals": [r.describe() for r in model_plan.refusals],
        **(
            {"unfused": [u.describe() for u in model_plan.unfused]}
            if model_plan.unfused
            else {}
        ),
    }


def read(out_dir: Path) -> dict:
    path = out_dir / NAME
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable manifest: {exc}") from None


def render(manifest: dict) -> str:
    return json.dumps(dict(sorted(manifest.items())), indent=2) + "\n"


def lost_fusions(recorded: dict, new: dict) -> list[str]:
    """Fusions the manifest records that `new` no longer produces (or produces fewer of)."""
    lost = []
    for cls, fusions in recorded.get("fusions", {}).items():
        for key, count in fusions.items():
            have = new.get("fusions", {}).get(cls, {}).get(key, 0)
            if have < count:
                lost.append(f"{cls}: {key}" + (f" ({have} of {count})" if have else ""))
    return lost
