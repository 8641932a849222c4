"""verify's one-line error names what failed: where vLLM's engine says only that its
start failed ("See root cause above"), the exception a worker raised, from the log
verify keeps aside. Engine-free: the log lines are vLLM 0.32's, as a PP=2 run of a file
reading a placeholder layer printed them."""

from __future__ import annotations

from codemods.verify import with_root_cause

ENGINE = (
    "could not run: RuntimeError: Engine core initialization failed. See root cause "
    "above. Failed core proc(s): {'EngineCore': 1}"
)
LOG = """\
(Worker_PP0 pid=31509) ERROR 12-07 03:41:13 [multiproc_executor.py:953]     if layer.self_attn.is_kv_shared_layer:
(Worker_PP0 pid=31509) ERROR 12-07 03:41:13 [multiproc_executor.py:953]     raise AttributeError(
(Worker_PP0 pid=31509) ERROR 12-07 03:41:13 [multiproc_executor.py:953] AttributeError: 'PPMissingLayer' object has no attribute 'self_attn'
(EngineCore pid=31500) ERROR 12-07 03:41:14 [core.py:1100] RuntimeError: Engine core initialization failed. See root cause above.
"""


def test_a_workers_exception_replaces_the_engines_see_above():
    assert with_root_cause(ENGINE, LOG) == (
        "could not run: AttributeError: 'PPMissingLayer' object has no attribute "
        "'self_attn' (in a worker: engine core initialization failed)"
    )


def test_other_errors_and_logs_without_a_worker_exception_are_kept():
    assert with_root_cause("could not run: ValueError: x", LOG) == (
        "could not run: ValueError: x"
    )
    engine_only = LOG.splitlines()[-1]
    assert with_root_cause(ENGINE, engine_only) == ENGINE


def test_a_sub_config_an_override_set_is_printed_as_its_fields():
    # `--override attn_config={...}` on DBRX: transformers turns the dict into a
    # DbrxAttentionConfig in place, which the JSON line raised on
    import json

    from transformers.models.dbrx.configuration_dbrx import DbrxAttentionConfig

    from codemods.verify import _plain

    result = {"overrides": {"attn_config": DbrxAttentionConfig(kv_n_heads=2)}}
    line = json.loads(json.dumps(result, default=_plain))
    assert line["overrides"]["attn_config"]["kv_n_heads"] == 2


def test_the_backend_alone_on_a_source_with_no_tiny_model_says_so_in_one_line():
    # a refused row's backend run (coverage): the source's own tiny model fails first,
    # in the subprocess the backend would run in
    from codemods.verify import safe_backend_only

    result = safe_backend_only("modeling_qwen4_exp.py")
    assert result == {
        "ok": False,
        "error": "no tiny checkpoint: cannot build a tiny Qwen4ExpForCausalLM from the "
        "source: TypeError: unsupported operand type(s) for //: 'NoneType' and "
        "'NoneType'",
    }
