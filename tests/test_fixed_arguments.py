"""Constructions the model's own arguments rule out, engine-free: a class built only on
the side of a constructor flag that every construction from the causal LM fixes the
other way is not a kind the model can build (Moshi's depth-decoder linears)."""

from __future__ import annotations

import libcst as cst

from codemods import branches
from codemods.source import class_infos

SOURCE = """
class Model:
    def __init__(self, config):
        self.layer = Layer(config, flexible={flag})

class Other:
    def __init__(self, config):
        self.layer = Layer(config, flexible=True)

class Layer:
    def __init__(self, config, flexible=False):
        n = config.num_codebooks if flexible else 1
        if n == 1:
            self.mlp = Dense(config)
        else:
            self.mlp = Flexible(config, n)

class Dense:
    def __init__(self, config):
        pass

class Flexible:
    def __init__(self, config, n):
        pass
"""


def _kinds(flag: str) -> dict:
    classes = class_infos(cst.parse_module(SOURCE.format(flag=flag)))
    return branches.reachable_kinds(classes, "Model", {"Model", "Layer", "Dense"})


def test_a_flag_every_construction_fixes_rules_its_other_side_out():
    # the guard reads `config.num_codebooks` (a config field), but only where
    # `flexible` is true, and the one construction reached passes False; `Other`,
    # which passes True, is not built by Model
    assert "Flexible" not in _kinds("False")
    assert "Dense" in _kinds("False")


def test_a_flag_a_construction_leaves_open_keeps_both_sides():
    # able to fail: passed from the config (or true), the other side is a kind again
    assert "Flexible" in _kinds("config.flexible")
    assert "Flexible" in _kinds("True")


def test_moshis_text_model_builds_no_depth_decoder_linears():
    """MoshiForCausalLM's layers get `use_flexible_linear=False`: its tiny configs are
    not asked to build `MoshiFlexibleLinear` (apply refused the model for it)."""
    from codemods import layer_kinds, tiny
    from codemods import loading
    from codemods.roles import causal_class
    from codemods.source import load

    src = load("modeling_moshi.py")
    causal = causal_class(loading.load_module(src), src.classes, src)
    found = layer_kinds.cover(
        causal, src.module, src.classes, tiny.working_values(causal)
    )
    assert "MoshiFlexibleLinear" not in found.kinds
    assert not found.unbuilt
    assert {"MoshiAttention", "MoshiGatingMLP"} <= found.built[0]
