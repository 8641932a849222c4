"""Experts routed by the source's own router (`fusion_patterns/routed_experts.py`), on
edited copies of a real transformers source whose router vLLM's routing does not
reproduce (PhiMoE: a sparse mixer). Engine-free: what is claimed, what the file holds,
what is refused; `verify` runs the claimed files in vLLM (the coverage run, the faithful
engine tests, the able-to-fail copies)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import edited_modeling_file

from codemods.apply import generate
from codemods.source import transformers_root

SOURCE = next(transformers_root().glob("models/phimoe/modeling_phimoe.py")).read_text()
EXPERTS = "PhimoeExperts"
CALL = "self.experts(hidden_states, selected_experts, routing_weights)"


def mutant(tmp_path: Path, old: str, new: str) -> str:
    return str(edited_modeling_file(tmp_path, "modeling_phimoe.py", old, new))


def experts_lines(plan, prefix: str) -> list[str]:
    """The report's lines on the experts class, but its activation built by name (a
    copied class's `ACT2FN[...]` through vLLM's ops: test_activation.py)."""
    return [
        line
        for line in plan.report()
        if line.startswith(prefix)
        and f"({EXPERTS})" in line
        and not line.startswith("Fused: ACT2FN[")
    ]


def test_experts_behind_an_unproven_router_run_as_fused_moe():
    plan, text = generate("modeling_phimoe.py")
    # the block's router is not vLLM's: the block stays the source's
    assert any(r.source_class == "PhimoeSparseMoeBlock" for r in plan.refusals)
    [fused] = experts_lines(plan, "Fused:")
    assert "-> experts (FusedMoE, external routing" in fused
    tree = ast.parse(text)
    # the experts are vLLM's fused layer, built with the block's layer name (its
    # forward context needs one per layer) and the source's top-k
    factory = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == EXPERTS
    )
    body = ast.unparse(factory)
    assert "FusedMoEFactory(" in body and "runner_cls=TransformersMoERunner" in body
    assert "top_k=config.num_experts_per_tok" in body and "prefix=prefix" in body
    assert 'prefix=f"{prefix}.experts"' in text
    # the loop over the experts is gone, and with it the reason to run eagerly
    assert ".nonzero()" not in text
    assert "@support_torch_compile" in text
    assert not any("torch.compile" in line for line in plan.report())
    assert not any("Python loop" in line for line in plan.report())


def test_experts_that_compute_something_else_are_refused_and_copied(tmp_path):
    edited = mutant(
        tmp_path,
        "current_hidden_states = self.act_fn(gate) * up",
        "current_hidden_states = self.act_fn(up) * gate",
    )
    plan, text = generate(edited, trust_remote_code=True)
    [refused] = experts_lines(plan, "Refused:")
    assert "the fused form differs" in refused
    assert not experts_lines(plan, "Fused:")
    assert f"class {EXPERTS}(nn.Module)" in text  # copied, as the source computes it
    assert any("torch.compile" in line for line in plan.report())
    # the loop over the experts a batch hits, a slow path said as one
    assert any(
        line.startswith(f"Unfused: Python loop ({EXPERTS})") for line in plan.report()
    )


def test_experts_called_by_keyword_are_refused(tmp_path):
    """vLLM's runner names its arguments differently: only a positional call is taken."""
    edited = mutant(
        tmp_path,
        CALL,
        "self.experts(hidden_states, top_k_index=selected_experts, "
        "top_k_weights=routing_weights)",
    )
    plan, _ = generate(edited, trust_remote_code=True)
    [refused] = experts_lines(plan, "Refused:")
    assert "positionally" in refused


def test_experts_handed_weights_before_ids_stay_the_sources(tmp_path):
    # the block hands (weights, ids): the experts' own signature swapped to match
    text = SOURCE.replace(
        CALL, "self.experts(hidden_states, routing_weights, selected_experts)"
    )
    start = text.index(f"class {EXPERTS}(")
    head, tail = text[:start], text[start:]
    tail = tail.replace(
        "top_k_index: torch.Tensor,\n        top_k_weights: torch.Tensor,",
        "top_k_weights: torch.Tensor,\n        top_k_index: torch.Tensor,",
        1,
    )
    assert tail != text[start:]
    path = tmp_path / "modeling_phimoe.py"
    path.write_text(head + tail)
    plan, text = generate(str(path), trust_remote_code=True)
    # not called as vLLM's runner is: the experts stay the source's loop, and say so
    assert not experts_lines(plan, "Fused:")
    assert f"class {EXPERTS}(nn.Module)" in text
    assert any(line.startswith("Unfused: torch.compile") for line in plan.report())


# --- experts stacked [E, H, 2I], applied as x @ W (transposed.py) ------------------


def test_gpt_oss_interleaved_clamped_experts_are_vllms_swigluoai():
    """GPT-OSS: gate/up interleaved, biased, clamped: vLLM's fused swigluoai, loaded per
    expert through vLLM's loader for that layout; the loop and the eager run gone."""
    plan, text = generate("modeling_gpt_oss.py")
    [fused] = [
        line
        for line in plan.report()
        if line.startswith("Fused:") and "(GptOssExperts)" in line
    ]
    assert "-> experts (FusedMoE, external routing" in fused
    factory = ast.unparse(
        next(
            n
            for n in ast.parse(text).body
            if isinstance(n, ast.FunctionDef) and n.name == "GptOssExperts"
        )
    )
    for arg in (
        "activation='swigluoai'",
        "has_bias=True",
        "routed_experts_cls=GptOssRoutedExperts",
    ):
        assert arg in factory, arg
    assert "(config.swiglu_alpha, config.swiglu_limit) != (1.702, 7.0)" in factory
    assert "def _interleaved_experts(" in text and "| loaded" in text
    assert ".nonzero()" not in text and "@support_torch_compile" in text


def test_the_generated_factory_refuses_a_clamp_vllm_does_not_compute():
    from types import SimpleNamespace

    import pytest

    from generated.gpt_oss import GptOssExperts

    with pytest.raises(ValueError, match="swiglu_limit=7.0 only"):
        GptOssExperts(SimpleNamespace(swiglu_alpha=1.702, swiglu_limit=5.0))


def test_experts_without_the_clamp_on_up_are_refused(tmp_path):
    edited = edited_modeling_file(
        tmp_path,
        "modeling_gpt_oss.py",
        "up = up.clamp(min=-self.limit, max=self.limit)",
        "up = up.clamp(min=None, max=self.limit)",
    )
    plan, text = generate(str(edited), trust_remote_code=True)
    [refused] = [
        line
        for line in plan.report()
        if line.startswith("Refused:") and "(GptOssExperts)" in line
    ]
    assert "neither layout computes them" in refused
    assert "class GptOssExperts(nn.Module)" in text


def test_aria_transposed_halves_are_vllms_stacked_experts_read_transposed():
    plan, text = generate("modeling_aria.py")
    assert any(
        line.startswith("Fused:") and "(AriaExperts)" in line for line in plan.report()
    )
    factory = ast.unparse(
        next(
            n
            for n in ast.parse(text).body
            if isinstance(n, ast.FunctionDef) and n.name == "AriaExperts"
        )
    )
    assert "activation='silu'" in factory
    assert "is_fused_checkpoint_transposed=True" in factory
    assert "_interleaved_experts" not in text


# --- experts as three [E * I, H] matrices of a child module (flattened.py) ----------


def flattened_table(text: str) -> dict[str, str]:
    """The generated loader's {source matrix: vLLM per-expert name} table."""
    tree = ast.parse(text)
    [table] = [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "flattened_experts" for t in n.targets)
    ]
    return ast.literal_eval(table)


def test_dbrx_flattened_experts_are_fused_moe_loaded_per_expert():
    plan, text = generate("modeling_dbrx.py")
    assert any(
        line.startswith("Fused:") and "(DbrxExperts)" in line for line in plan.report()
    )
    # w1 is activated (gate), v1 multiplies it (up), w2 is applied as h @ W_e (down)
    assert flattened_table(text) == {
        "w1": "gate_proj",
        "v1": "up_proj",
        "w2": "down_proj",
    }
    assert "tensor = tensor.transpose(1, 2)" in text
    # DBRX hands [batch, tokens, hidden]: flattened for vLLM's layer, shaped back
    assert ".reshape(-1, hidden_states.shape[-1])" in text and ".view_as(" in text
    assert ".nonzero()" not in text and "@support_torch_compile" in text


def test_dbrx_roles_follow_the_source_not_the_names(tmp_path):
    # the source activating v1 and multiplying by w1: the table swaps with it
    edited = edited_modeling_file(
        tmp_path,
        "modeling_dbrx.py",
        "gate_proj = x.matmul(expert_w1.T)\n        up_proj = x.matmul(expert_v1.T)",
        "gate_proj = x.matmul(expert_v1.T)\n        up_proj = x.matmul(expert_w1.T)",
    )
    plan, text = generate(str(edited), trust_remote_code=True)
    assert flattened_table(text) == {
        "v1": "gate_proj",
        "w1": "up_proj",
        "w2": "down_proj",
    }


def test_dbrx_experts_computing_something_else_are_refused(tmp_path):
    # the activation applied after the product: no assignment of w1/v1/w2 computes it
    edited = edited_modeling_file(
        tmp_path,
        "modeling_dbrx.py",
        "gate_proj = self.activation_fn(gate_proj)\n"
        "        intermediate_states = gate_proj * up_proj",
        "intermediate_states = self.activation_fn(gate_proj * up_proj)",
    )
    plan, text = generate(str(edited), trust_remote_code=True)
    [refused] = [
        line
        for line in plan.report()
        if line.startswith("Refused:") and "(DbrxExperts)" in line
    ]
    assert "no assignment of their matrices computes them" in refused
    assert "class DbrxExperts(nn.Module)" in text
    assert any(line.startswith("Unfused: torch.compile") for line in plan.report())


def test_a_top_k_the_router_reads_off_self_config_is_found():
    """Gemma 4's router takes `k=self.config.top_k_experts` (the module keeps the config
    it is built from): the experts' top-k is that field, and they run as FusedMoE."""
    import ast

    from transformers import Gemma4TextConfig

    plan, text = generate("modeling_gemma4.py")
    assert any(
        line.startswith("Fused: gate_up_proj + down_proj (Gemma4TextExperts)")
        and "FusedMoE" in line
        for line in plan.report()
    )
    # the fused experts' top_k, evaluated on a config whose top-k differs from every
    # other count, is the router's field
    (top_k,) = [
        kw.value
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) in ("FusedMoE", "FusedMoEFactory")
        for kw in node.keywords
        if kw.arg == "top_k"
    ]
    config = Gemma4TextConfig(enable_moe_block=True, num_experts=8, top_k_experts=3)
    assert eval(ast.unparse(top_k), {"config": config}) == 3  # noqa: S307


def test_a_loop_over_a_data_dependent_value_is_found_and_no_other():
    from codemods.assembly.compile import data_loops

    body = (
        "class Experts(nn.Module):\n"
        "    def forward(self, x, mask):\n"
        "        hit = mask.sum(0).nonzero().squeeze(-1)\n"
        "        for i in hit:\n"
        "            x = x + i\n"
        "        for j in range(4):\n"
        "            x = x * 2\n"
        "        for k in mask.nonzero():\n"
        "            x = x - k\n"
        "        return x\n"
    )
    assert data_loops(body) == [("Experts", "hit"), ("Experts", "mask.nonzero()")]
