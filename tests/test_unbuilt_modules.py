"""Constants every caller hands a copied class, folded into it; a base-model module
left returning an input unchanged is not built and its checkpoint tensors are skipped
(Phi-4-multimodal's image and audio towers, which a text model never runs)."""

from __future__ import annotations

import pytest

from codemods.assembly import constant_arguments

EXTEND = """
class Extend(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.tower = Tower(config)

    def forward(self, input_ids, inputs_embeds, pixels=None):
        with torch.no_grad():
            mask = (input_ids == 3).unsqueeze(-1)
        if pixels is not None:
            inputs_embeds = torch.where(mask, self.tower(pixels), inputs_embeds)
        return inputs_embeds
"""

BASE = """
class Base(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        if get_pp_group().is_first_rank:
            self.extend = Extend(config)
        else:
            self.extend = PPMissingLayer()

    def forward(self, input_ids, positions):
        inputs_embeds = self.embed_tokens(input_ids)
        inputs_embeds = self.extend(input_ids, inputs_embeds, pixels={pixels})
        return inputs_embeds
"""


def _fold(pixels: str, extra_base: str = ""):
    pieces = {"Extend": EXTEND, "Base": BASE.format(pixels=pixels) + extra_base}
    return pieces, constant_arguments.fold(pieces, "Base")


def test_a_module_every_call_hands_constants_that_leave_it_an_identity_is_not_built():
    pieces, unbuilt = _fold("None")
    assert [(u.attr, u.cls, u.returns) for u in unbuilt] == [
        ("extend", "Extend", "inputs_embeds")
    ]
    assert unbuilt[0].constants == {"pixels": "None"}
    base = pieces["Base"]
    assert "self.extend" not in base and "PPMissingLayer" not in base
    assert "inputs_embeds = inputs_embeds" not in base
    assert "inputs_embeds = self.embed_tokens(input_ids)" in base


@pytest.mark.parametrize("pixels", ["pixel_values", "torch.ones(1)"])
def test_a_value_that_is_not_a_constant_keeps_the_module(pixels):
    # able to fail: the tower may run, so the module is built and called as before
    pieces, unbuilt = _fold(pixels)
    assert unbuilt == []
    assert "self.extend = Extend(config)" in pieces["Base"]
    assert "self.tower(pixels)" in pieces["Extend"]


def test_callers_that_disagree_fold_nothing():
    # a second call of the same module with another value: `pixels` is not one constant
    second = (
        "\n    def other(self, ids, e):\n        return self.extend(ids, e, pixels=1)\n"
    )
    pieces, unbuilt = _fold("None", second)
    assert unbuilt == []
    assert "if pixels is not None:" in pieces["Extend"]


def test_a_module_handed_on_is_not_folded():
    # `self.extend` read other than by a call: its calls are not all its uses
    handed = "\n    def other(self):\n        return self.extend\n"
    pieces, unbuilt = _fold("None", handed)
    assert unbuilt == []
    assert "if pixels is not None:" in pieces["Extend"]


def test_phi4_multimodal_serves_its_text_model_without_its_towers():
    from codemods.apply import generate

    plan, text = generate("modeling_phi4_multimodal.py")
    assert "class Phi4MultimodalAudioModel" not in text
    assert "class Phi4MultimodalVisionModel" not in text
    assert 'ignore_unexpected_prefixes=["model.embed_tokens_extend."]' in text
    report = plan.report()
    assert any(
        line.startswith(
            "Kept: module not built (Phi4MultimodalModel): embed_tokens_extend "
            "(Phi4MultimodalFeatureEmbedding) returns `inputs_embeds` unchanged"
        )
        for line in report
    )
    # nothing reported of the classes the file no longer holds
    assert not [line for line in report if "Phi4MultimodalAudio" in line]
    assert plan.layout == "native"
