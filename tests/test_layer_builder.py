"""A layer list built by a method of the base model (Zamba 2's `get_layers`): each module
it builds is built by vLLM's `make_layers` under the path it lands at, this stage's
layers only; the modules the source ties to another get the checkpoint's tensors."""

from __future__ import annotations

import libcst as cst
import pytest

from codemods.assembly import layer_builder, tied_modules
from codemods.copying.classes import Context
from codemods.errors import CodemodError
from codemods.source import class_infos
from fusion_patterns.base import code

SOURCE = """
class Mixer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Shared(nn.Module):
    def __init__(self, config, block_id=None):
        super().__init__()
        self.proj = nn.Linear(4, 4)


class Hybrid(nn.Module):
    def __init__(self, shared, linear, mixer):
        super().__init__()
        self.linear = linear
        self.mixer_layer = mixer
        self.shared = shared


class Model(PreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.layers = self.get_layers()

    def get_layers(self):
        layers = []
        self._tied_weights_keys = {}
        count = 0
        for layer_id, kind in enumerate(self.config.kinds):
            mixer = Mixer(self.config, layer_idx=layer_id)
            if kind == "hybrid":
                block = Shared(self.config, block_id=count % 2)
                count += 1
                linear = nn.Linear(4, 4, bias=False)
                layers.append(Hybrid(block, linear, mixer))
            else:
                layers.append(mixer)
        return nn.ModuleList(layers)
"""


def _builders(source: str):
    classes = class_infos(cst.parse_module(source))
    ctx = Context(
        classes=classes,
        constructions={},
        prefix_classes={"Mixer", "Shared"},
        attention={},
    )
    method = layer_builder.builder_method(classes["Model"].node.body.body[1], ctx)
    return classes, code(method)


class _Built:
    """Stands in for every class the builders construct: records what it was given."""

    made: list = []

    def __init__(self, *args, prefix=None, quant_config=None, **kwargs):
        self.args, self.kwargs, self.prefix = args, kwargs, prefix
        _Built.made.append(self)


def _run(text: str, kinds: list[str]):
    import itertools
    import textwrap
    import types

    scope = {
        "Mixer": type("Mixer", (_Built,), {}),
        "Shared": type("Shared", (_Built,), {}),
        "Hybrid": type("Hybrid", (_Built,), {}),
        "ReplicatedLinear": type("ReplicatedLinear", (_Built,), {}),
        "cycle": itertools.cycle,
    }
    exec(textwrap.dedent(text), scope)
    owner = types.SimpleNamespace(config=types.SimpleNamespace(kinds=kinds))
    _Built.made = []
    builders = scope["get_layers"](owner, None)
    return owner, [b(f"model.layers.{i}") for i, b in enumerate(builders)]


def test_each_module_is_built_at_the_path_it_lands_at_with_its_own_iteration():
    classes, text = _builders(SOURCE)
    owner, layers = _run(text, ["mamba", "hybrid", "hybrid"])
    assert [type(x).__name__ for x in layers] == ["Mixer", "Hybrid", "Hybrid"]
    assert layers[0].prefix == "model.layers.0"
    shared, linear, mixer = layers[2].args
    assert shared.prefix == "model.layers.2.shared"
    assert linear.prefix == "model.layers.2.linear"
    assert mixer.prefix == "model.layers.2.mixer_layer"
    # each builder binds its own iteration's values, not the loop's last ones
    assert mixer.kwargs["layer_idx"] == 2 and layers[1].args[2].kwargs["layer_idx"] == 1
    assert [layers[i].args[0].kwargs["block_id"] for i in (1, 2)] == [0, 1]
    # nn.Linear built beside the layer: vLLM's replicated linear, returning a tensor
    assert linear.kwargs["return_bias"] is False
    assert owner._tied_weights_keys == {}


def test_nothing_is_built_until_a_stage_asks_for_its_layers():
    _, text = _builders(SOURCE)
    import itertools
    import textwrap
    import types

    scope = {"cycle": itertools.cycle}
    exec(textwrap.dedent(text), scope)
    owner = types.SimpleNamespace(config=types.SimpleNamespace(kinds=["hybrid"] * 3))
    # the classes are not even defined: building any module would raise NameError
    assert len(scope["get_layers"](owner, None)) == 3


def test_a_built_module_read_otherwise_is_refused_by_name():
    source = SOURCE.replace(
        "layers.append(Hybrid(block, linear, mixer))",
        "print(mixer)\n                layers.append(Hybrid(block, linear, mixer))",
    )
    with pytest.raises(CodemodError, match="uses the module it builds as mixer"):
        _builders(source)


def test_a_module_handed_to_an_argument_the_layer_does_not_store_is_refused():
    source = SOURCE.replace("self.mixer_layer = mixer", "self.mixer_layer = None")
    with pytest.raises(CodemodError, match="Hybrid is handed mixer"):
        _builders(source)


def test_tied_modules_get_the_tensors_saved_once():
    import textwrap
    import types
    from collections.abc import Iterable

    import torch

    scope = {"Iterable": Iterable, "torch": torch}
    text = tied_modules.TIED_COPIES.format(base="model")
    exec(textwrap.dedent(text), scope)
    owner = types.SimpleNamespace(
        model=types.SimpleNamespace(
            _tied_weights_keys={
                "layers.3.shared": "layers.1.shared",
                "layers.5.shared": "layers.1.shared",
            }
        )
    )
    t = torch.zeros(1)
    names = [
        n
        for n, _ in scope["_tied_copies"](
            owner,
            [("model.layers.1.shared.w", t), ("model.layers.10.shared.w", t)],
        )
    ]
    assert names == [
        "model.layers.1.shared.w",
        "model.layers.3.shared.w",
        "model.layers.5.shared.w",
        "model.layers.10.shared.w",  # layers.10 is not layers.1
    ]


def test_what_the_layers_read_of_the_embeddings_values_travels_between_stages():
    from codemods.assembly.base_forward import _side_streams

    body = cst.parse_module(
        "hidden_states = inputs_embeds\n"
        "original = torch.clone(inputs_embeds)\n"
        "length = inputs_embeds.shape[1]\n"
        "for layer in self.layers:\n"
        "    hidden_states = layer(hidden_states, original, length)\n"
    ).body
    prelude, loop = body[:3], body[3]
    # the clone reads the embeddings' values; the length only their shape
    assert _side_streams(prelude, loop, ["hidden_states"], {"inputs_embeds"}) == [
        "original"
    ]


def test_tied_copies_hold_one_set_of_weights_and_keep_their_own_attention():
    import textwrap

    import torch
    from torch import nn

    class AttentionLayerBase(nn.Module):
        pass

    class PPMissingLayer(nn.Module):
        pass

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)
            self.inner = nn.Module()
            self.inner.attn = AttentionLayerBase()
            self.inner.out = nn.Linear(2, 2)
            self.scale = nn.Parameter(torch.ones(1))

    scope = {
        "nn": nn,
        "AttentionLayerBase": AttentionLayerBase,
        "PPMissingLayer": PPMissingLayer,
    }
    exec(textwrap.dedent(tied_modules.SHARE_TIED), scope)
    model = nn.Module()
    model.layers = nn.ModuleList([PPMissingLayer(), Block(), Block(), Block()])
    model._tied_weights_keys = {"layers.2": "layers.0", "layers.3": "layers.0"}
    scope["share_tied_weights"](model)
    # layers.0 is on another stage: the first copy here (layers.1) holds the weights
    first, second = model.layers[2], model.layers[3]
    assert first.proj is second.proj and first.inner.out is second.inner.out
    assert first.scale is second.scale
    assert first.inner.attn is not second.inner.attn  # each its own KV cache
    assert model.layers[1].proj is not first.proj  # not tied: its own weights
    assert len(list(model.parameters())) == 5 + 5  # layers.1, and one set for 2 and 3
