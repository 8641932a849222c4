"""The sharding trap is caught: a copy of the generated model that loads the merged q/k/v
weight with a contiguous split (not per shard id) is correct at TP=1 and silently wrong at
TP=2, and verification at TP=2 must fail on it."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, run_cli

pytestmark = pytest.mark.engine

ORIGINAL = """    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)"""

CONTIGUOUS = """    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.distributed import get_tensor_model_parallel_rank

        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        parts, rest = {}, []
        for name, tensor in weights:
            for proj in ("q_proj", "k_proj", "v_proj"):
                if f".self_attn.{proj}." in name:
                    merged = name.replace(f".{proj}.", ".qkv_proj.")
                    parts.setdefault(merged, {})[proj] = tensor
                    break
            else:
                rest.append((name, tensor))
        params = dict(self.named_parameters())
        for name, p in parts.items():
            merged = torch.cat([p["q_proj"], p["k_proj"], p["v_proj"]])
            params[name].data.copy_(merged.chunk(tp)[rank])  # WRONG on purpose
        loader = AutoWeightsLoader(self)
        return set(parts) | loader.load_weights(rest, mapper=self.hf_to_vllm_mapper)"""


def _verify(path, *args):
    result = run_cli("codemods.verify", str(path), *args)
    return result.returncode, json.loads(result.stdout.strip().splitlines()[-1])


def test_contiguous_split_is_caught_at_tp2(tmp_path):
    text = (REPO / "generated" / "qwen3.py").read_text()
    assert text.count(ORIGINAL) == 1
    trap = tmp_path / "qwen3.py"
    trap.write_text(text.replace(ORIGINAL, CONTIGUOUS))
    rc, out = _verify(trap)
    # a contiguous split is right on one rank: the trap's own copy ran, and matched
    assert rc == 0 and out["ok"], out
    assert out["impl"].startswith("_verify_qwen3_") and out["tp"] == 1, out
    assert out["tokens_equal"] and out["max_abs_logprob_diff"] <= 1e-4, out

    rc, out = _verify(trap, "--tp", "2")  # the shapes fit: nothing raises
    assert rc == 1 and not out["ok"], out
    assert out["impl"].startswith("_verify_qwen3_") and out["tp"] == 2, out
    # wrong numbers, not a crash: verify ran both and compared them
    assert out["max_abs_logprob_diff"] > 1e-4, out
