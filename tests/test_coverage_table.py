"""The coverage table's comparison with vLLM's Transformers backend and its TP=2 cell,
on report lines in the forms the backend and the generated files write them."""

from __future__ import annotations

from conftest import coverage_script

coverage = coverage_script()

BACKEND = [
    "Fused: q_proj + k_proj + v_proj (self_attn: OlmoAttention) -> qkv_proj (QKVParallelLinear)",
    "Found: self_attn (OlmoAttention) -> attention interface",
    "Fused: q_norm (OlmoRMSNorm) -> RMSNorm (CustomOp)",
    "Fused: experts (OlmoExperts) -> MoERunner (external routing)",
]


def test_every_backend_part_fused_here_is_all():
    ours = [
        "Fused: q_proj + k_proj + v_proj (OlmoAttention) -> qkv_proj (QKVParallelLinear)",
        "Fused: q_norm (OlmoAttention) -> q_norm (RMSNorm, weight in fp32, before the cast back)",
        "Fused: gate_up_proj + down_proj (OlmoExperts) -> experts (FusedMoE, external routing)",
    ]
    assert coverage.backend_misses(ours, BACKEND) == []
    row = {"fused": ours, "backend": {"fused": BACKEND}, "refusals": []}
    assert coverage.backend_cell(row) == "all"


def test_a_part_the_backend_fuses_and_this_file_does_not_is_named_with_its_refusal():
    ours = [
        # the norm of another attribute, the projections of another class
        "Fused: k_norm (OlmoAttention) -> k_norm (RMSNorm)",
        "Fused: q_proj + k_proj + v_proj (OtherAttention) -> qkv_proj (QKVParallelLinear)",
        "Fused: gate_up_proj + down_proj (OlmoExperts) -> experts (FusedMoE, external routing)",
    ]
    assert coverage.backend_misses(ours, BACKEND) == [
        ("q_proj + k_proj + v_proj", "OlmoAttention"),
        ("q_norm", "OlmoRMSNorm"),
    ]
    row = {
        "fused": ours,
        "backend": {"fused": BACKEND},
        "refusals": [
            "Refused: q/k/v projections (OlmoAttention): key_states is assigned twice"
        ],
    }
    cell = coverage.backend_cell(row)
    assert cell.startswith(
        "misses q_proj + k_proj + v_proj (OlmoAttention): key_states"
    )
    assert "q_norm (OlmoRMSNorm)" in cell


def test_a_packed_projection_is_covered_by_its_class_and_target():
    backend = ["Fused: c_attn (attn: GPTBigCodeAttention) -> QKVParallelLinear"]
    assert coverage.backend_misses([], backend) == [("c_attn", "GPTBigCodeAttention")]
    ours = ["Fused: c_attn (GPTBigCodeAttention) -> c_attn (QKVParallelLinear, packed)"]
    assert coverage.backend_misses(ours, backend) == []


def test_the_tp2_cell_names_what_stays_whole_above_the_bound():
    row = {
        "tp2": {"ok": True, "rank_share": 0.91},
        "unfused": [
            "Unfused: tensor parallel (FalconAttention): replicated: self.dense (FalconLinear)",
            "Unfused: module (FalconMLP): copied from the source",
        ],
    }
    assert coverage.tp2_cell(row) == "0.91: whole on every rank: FalconAttention"
    assert coverage.tp2_cell({"tp2": {"ok": True, "rank_share": 0.5}}) == "0.50"
    latent = {
        "tp2": {"ok": True, "rank_share": 0.69},
        "kept": [
            "Kept: tensor parallel (Glm4MoeLiteAttention): fused_qkv_a_proj whole on "
            "every rank: the latent's down-projections, as vLLM's own deepseek_v2.py"
        ],
    }
    assert coverage.tp2_cell(latent) == (
        "0.69: whole on every rank: Glm4MoeLiteAttention (as vLLM's own)"
    )
    assert coverage.tp2_cell({"tp2": {"ok": False, "error": "boom"}}) == "FAIL: boom"


def test_an_out_of_scope_row_says_its_status_once():
    reason = "out of scope: encoder (bidirectional: ...): vLLM serves such models as pooling models"
    row = {"file": "modeling_x.py", "status": "out of scope", "reason": reason}
    table = coverage.markdown([row], {"modeling_x.py": ["x"]}, 60)
    line = next(l for l in table.splitlines() if l.startswith("| modeling_x.py"))
    assert "| out of scope: encoder (bidirectional: ...)" in line
    assert "out of scope: out of scope" not in line


def _cells(row: dict) -> list[str]:
    table = coverage.markdown([row], {row["file"]: ["x"]}, 60)
    line = next(l for l in table.splitlines() if l.startswith(f"| {row['file']}"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_a_refused_row_says_what_the_backend_does_with_the_same_model():
    # nothing generated: the backend's own run is what a user of vLLM gets instead
    wrong = {
        "ok": False,
        "max_abs_logprob_diff": 0.82,
        "tokens_equal": False,
        "fused": ["Fused: input_layernorm (DogeRMSNorm) -> RMSNorm (CustomOp)"],
    }
    row = {
        "file": "modeling_doge.py",
        "status": "refused",
        "reason": "cannot ...",
        "backend": wrong,
    }
    cells = _cells(row)
    assert cells[8] == "wrong (8.2e-01, tokens differ)"
    assert cells[9] == "1"  # its one Fused: line
    failing = {**row, "backend": {"ok": False, "error": "no tiny checkpoint: X"}}
    assert _cells(failing)[8] == "fails: no tiny checkpoint: X"
    # an out-of-scope row is not one the backend is asked to serve
    other = {"file": "modeling_y.py", "status": "out of scope", "reason": "encoder"}
    assert _cells(other)[8] == "-"


def test_a_validator_error_is_said_by_its_own_message():
    from codemods.errors import error_line

    error = (
        "1 validation error for ModelConfig\n"
        "  Value error, The Transformers implementation of 'X' is not compatible "
        "with vLLM. [type=value_error, input_value=ArgsKwargs((), {})]\n"
        "    For further information visit https://errors.pydantic.dev"
    )
    assert error_line(error) == (
        "The Transformers implementation of 'X' is not compatible with vLLM."
    )
    assert error_line("KeyError: 'vllm'\nmore") == "KeyError: 'vllm'"
