"""Dead work, engine-free: a value the copied attention no longer reads (vLLM's
`Attention` holds the ALiBi slopes and the masking) is no longer handed down by the
decoder layer, nor computed every forward by the base model; what has an effect or is
still read stays."""

from __future__ import annotations

import textwrap

import libcst as cst

from codemods.assembly import unread_arguments
from codemods.assembly.pure_calls import PureCalls

CALLEE = """
class Attn(nn.Module):
    def __init__(self, config):
        self.proj = nn.Linear(4, 4)

    def forward(self, hidden_states, alibi, mask):
        return self.proj(hidden_states) {use}
"""
CALLER = """
class Layer(nn.Module):
    def __init__(self, config):
        self.attn = Attn(config)

    def forward(self, hidden_states, alibi, mask):
        return self.attn(hidden_states, alibi=alibi, mask=mask)
"""


def _pieces(use: str) -> dict[str, str]:
    return {
        "Attn": textwrap.dedent(CALLEE.format(use=use)),
        "Layer": textwrap.dedent(CALLER),
    }


def test_an_argument_the_callee_does_not_read_is_not_passed():
    pieces = _pieces("")
    unread_arguments.drop(pieces)
    assert "return self.attn(hidden_states)" in pieces["Layer"]
    # no caller passes them: they get a default
    assert "def forward(self, hidden_states, alibi=None, mask=None)" in pieces["Attn"]


def test_an_argument_the_callee_reads_is_still_passed():
    pieces = _pieces("* alibi")
    unread_arguments.drop(pieces)
    assert "self.attn(hidden_states, alibi=alibi)" in pieces["Layer"]
    assert "alibi, mask=None)" in pieces["Attn"]


def test_an_attribute_built_as_another_class_somewhere_keeps_its_arguments():
    pieces = _pieces("")
    pieces["Layer"] = pieces["Layer"].replace(
        "self.attn = Attn(config)",
        "self.attn = Attn(config) if config.x else Other(config)",
    )
    unread_arguments.drop(pieces)
    assert "alibi=alibi, mask=mask" in pieces["Layer"]


def _holds(stmt: str, methods: str = "", functions: str = "") -> bool:
    def defs(text):
        module = cst.parse_module(textwrap.dedent(text))
        return {f.name.value: f for f in module.body if isinstance(f, cst.FunctionDef)}

    node = cst.parse_statement(textwrap.dedent(stmt))
    return PureCalls(set(), defs(methods), defs(functions)).holds(node)


def test_tensor_ops_and_helpers_that_only_compute_are_pure():
    helper = """
    def build(mask, heads):
        slopes = torch.arange(1, 1 + heads, dtype=torch.float32)
        if heads > 2:
            slopes = torch.cat([slopes, slopes])
        return (mask.cumsum(dim=-1) * slopes[..., None]).to(torch.float32)
    """
    assert _holds("x = torch.ones((2, 3), device=h.device)")
    assert _holds("x = build(mask, 4)", functions=helper)
    assert _holds(
        "x = self.build(mask, 4)", methods=helper.replace("(mask", "(self, mask")
    )


def test_what_changes_state_is_not_pure():
    assert not _holds("x = mask.masked_fill_(m, 0)")  # in place
    assert not _holds("x = torch.add(a, b, out=c)")
    assert not _holds("x = self.attn(h)")  # a module with parameters or a cache
    assert not _holds("x = unknown(h)")
    sets_attr = """
    def build(self, mask):
        self.cache = mask
        return mask
    """
    assert not _holds("x = self.build(mask)", methods=sets_attr)
    in_place = """
    def build(mask):
        mask.mul_(2)
        return mask
    """
    assert not _holds("x = build(mask)", functions=in_place)


def _base_forward(text: str) -> str:
    start = text.index("class BloomModel(")
    return text[
        text.index("def forward(", start) : text.index("def build_alibi", start)
    ]


def test_bloom_builds_no_alibi_tensor_its_attention_does_not_read():
    from codemods.apply import generate

    _, text = generate("modeling_bloom.py")
    forward = _base_forward(text)
    assert "build_alibi_tensor(" not in forward and "torch.ones(" not in forward
    assert "outputs = block(hidden_states)" in forward
    # the slopes are vLLM's attention's, from the source's own function
    assert "alibi_slopes=alibi_slopes(" in text


def test_an_alibi_tensor_the_attention_still_reads_is_still_built(tmp_path):
    from codemods.apply import generate

    from conftest import edited_modeling_file

    path = edited_modeling_file(
        tmp_path,
        "modeling_bloom.py",
        "        batch_size, q_length, _ = hidden_states.shape\n",
        "        batch_size, q_length, _ = hidden_states.shape\n"
        "        hidden_states = hidden_states + 0 * alibi.mean()\n",
    )
    _, text = generate(str(path), trust_remote_code=True)
    forward = _base_forward(text)
    assert "alibi = self.build_alibi_tensor(" in forward
    assert "alibi=alibi" in forward
