"""The reference's own fp32 error: a tiny model that amplifies rounding is compared
against transformers' float64 run, and a wrong engine run still fails."""

from __future__ import annotations

import types

import pytest

from codemods import exact_reference, reference, tiny, verify
from codemods.exact_reference import ExactComparison


def test_the_exact_run_bounds_vllm_by_what_transformers_fp32_reaches():
    assert ExactComparison(to_exact=1.1e-4, reference_error=2.1e-4).holds(1e-4)
    # the same checkpoint on another CPU: transformers' own run landed closer
    assert ExactComparison(to_exact=1.2e-4, reference_error=8.4e-5).holds(1e-4)
    assert not ExactComparison(to_exact=3.5e-3, reference_error=1.6e-3).holds(1e-4)
    assert ExactComparison(to_exact=9e-5, reference_error=1e-6).holds(1e-4)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    import transformers

    cls = transformers.LlamaForCausalLM
    config = cls.config_class(**tiny.working_values(cls))
    ckpt = tmp_path_factory.mktemp("llama")
    model = tiny.build_checkpoint(cls, config, ckpt)
    prompts = verify.prompts_for(model.config.vocab_size)[:2]
    ref = reference.greedy_with_logprobs(model, prompts, 3)
    return cls, ckpt, prompts, ref


def _engine_like(prompts, ref, offset: float):
    """transformers' fp32 run in an engine run's shape, its logprobs moved by `offset`."""
    return types.SimpleNamespace(
        tokens=[r[0] for r in ref],
        logprobs=[
            [x + offset for x in exact_reference._path_logprobs(p, r)]
            for p, r in zip(prompts, ref)
        ],
    )


def test_a_run_off_by_more_than_the_reference_error_fails(tiny_llama):
    cls, ckpt, prompts, ref = tiny_llama
    wrong = _engine_like(prompts, ref, 1e-3)
    found = exact_reference.compare_to_exact(
        cls, ckpt, prompts, ref, wrong, 3, verify.compare
    )
    assert found is not None
    # a well-conditioned model: transformers' fp32 run is close to its float64 one
    assert found.reference_error < 1e-5
    assert found.to_exact == pytest.approx(1e-3, rel=0.05)
    assert not found.holds(1e-4)
    right = _engine_like(prompts, ref, 0.0)
    again = exact_reference.compare_to_exact(
        cls, ckpt, prompts, ref, right, 3, verify.compare
    )
    assert again.holds(1e-4) and again.to_exact == again.reference_error
