"""Each feature check can fail: switch one feature off in a copy of a generated model
and verification must then fail. All copies run in one process (one vLLM import)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

pytestmark = pytest.mark.engine

# (name, text in generated/qwen3.py, replacement): each switches one feature off.
MUTATIONS = [
    (
        "o_proj bias dropped",
        'bias=config.attention_bias,\n            quant_config=quant_config,\n            prefix=f"{prefix}.o_proj"',
        'bias=False,\n            quant_config=quant_config,\n            prefix=f"{prefix}.o_proj"',
    ),
    (
        "q norm dropped",
        "q = self.q_norm(q.view(-1, self.num_heads, self.head_dim)).view(q.shape)\n",
        "",
    ),
    ("sliding window dropped", "per_layer_sliding_window=self.sliding_window,", ""),
    (
        "tied head untied",
        "self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)",
        "pass",
    ),
]


def test_verification_fails_for_each_feature_switched_off(tmp_path):
    original = (REPO / "generated" / "qwen3.py").read_text()
    paths = []
    for i, (name, old, new) in enumerate(MUTATIONS):
        assert original.count(old) == 1, name
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        (folder / "qwen3.py").write_text(original.replace(old, new))
        paths.append(str(folder / "qwen3.py"))
    script = textwrap.dedent(
        f"""
        import json
        from codemods.verify import _safe_verify
        for path in {paths!r}:
            code, result = _safe_verify(path)
            print("RESULT " + json.dumps({{"code": code, **result}}), flush=True)
        """
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=900)
    results = [json.loads(line[7:]) for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(MUTATIONS), run.stderr[-3000:]
    for (name, _, _), result in zip(MUTATIONS, results):
        assert result["ok"] is False, (name, result)
        if result["code"] == 1:  # it ran: the copy ran, and the numbers differ
            assert result["impl"].startswith("_verify_qwen3_"), (name, result)
            assert result["max_abs_logprob_diff"] > 1e-3 or not result["tokens_equal"], (name, result)
        else:  # it refused to run: say why
            assert result["code"] == 2 and result["error"], (name, result)
