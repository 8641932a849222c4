"""Engine-free, two tensor-parallel ranks, faithful files: every linear of every rank
holds exactly its slice of the transformers weights (column-parallel: its rows,
row-parallel: its columns, merged q/k/v and gate/up: shard by shard, a projection packed
on disk: part by part, transformers' Conv1D: transposed, replicated: all), sharded
attention sinks their heads' slice, a rank holds at most 60% of the layers' bytes, and
every layer a rank holds whole is one the file's report names."""

from __future__ import annotations

import importlib
import importlib.util
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from conftest import REPO, load_on_rank

from codemods import tiny

TP = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _module(path: str):
    spec = importlib.util.spec_from_file_location(f"generated.{Path(path).stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(rank: int, port: int, path: str, causal: str, ckpt: str, out: str) -> None:
    from vllm.model_executor.layers.linear import LinearBase

    from codemods.engine import body_bytes

    cls = getattr(_module(path), causal)
    vllm_model, weights = load_on_rank(cls, ckpt, rank, port, TP)
    # before process_weights_after_loading, which repacks CPU weights
    linears = {
        name: (
            type(mod).__name__,
            mod.weight.detach().clone(),
            (None if getattr(mod, "bias", None) is None else mod.bias.detach().clone()),
        )
        for name, mod in vllm_model.named_modules()
        if isinstance(mod, LinearBase)
    }
    sinks = {
        name: p.detach().clone()
        for name, p in vllm_model.named_parameters()
        if name.endswith(".sinks")
    }
    # (class holding it, attribute) of every linear this rank holds whole
    whole = {
        (
            type(vllm_model.get_submodule(name.rsplit(".", 1)[0])).__name__,
            name.rsplit(".", 1)[1],
        )
        for name, mod in vllm_model.named_modules()
        if type(mod).__name__ == "ReplicatedLinear"
    }
    parts = {
        name: len(mod.output_sizes)
        for name, mod in vllm_model.named_modules()
        if type(mod).__name__ == "MergedColumnParallelLinear"
    }
    # a q/k/v packed on disk: its heads, to split the checkpoint tensor by
    parts |= {
        name: (mod.total_num_heads, mod.total_num_kv_heads, mod.head_size)
        for name, mod in vllm_model.named_modules()
        if type(mod).__name__ == "QKVParallelLinear"
    }
    torch.save(
        {
            "linears": linears,
            "sinks": sinks,
            "packed": vllm_model.packed_modules_mapping,
            "parts": parts,
            "whole": whole,
            "bytes": body_bytes(vllm_model),
        },
        f"{out}/rank{rank}.pt",
    )


def _expected(kind, name, hf, packed, rank, config, which="weight", parts=None):
    """The transformers tensor this rank's `name` must hold."""
    attr = name.rsplit(".", 1)[-1]

    def ref(n):
        t = hf[f"{n}.{which}"]
        if which == "weight" and n in CONV1D:  # stored [in, out]
            return t.t()
        return t

    if kind == "ReplicatedLinear":
        return ref(name)
    if kind == "ColumnParallelLinear":
        return ref(name).chunk(TP, 0)[rank]
    if kind == "RowParallelLinear":
        return ref(name) if which == "bias" else ref(name).chunk(TP, 1)[rank]
    if kind == "MergedColumnParallelLinear" and attr not in packed:
        # packed on disk (GPT-2's c_attn): each of its equal parts split over the ranks
        return torch.cat([p.chunk(TP, 0)[rank] for p in ref(name).chunk(parts, 0)])
    sources = [name[: -len(attr)] + s for s in packed[attr]]
    if kind == "MergedColumnParallelLinear":
        return torch.cat([ref(s).chunk(TP, 0)[rank] for s in sources])
    if kind == "QKVParallelLinear":
        if len(sources) == 1:  # packed [q; k; v] on disk (GPTBigCode's c_attn)
            heads, kv_heads, size = parts
            q, k, v = ref(name).split([heads * size, kv_heads * size, kv_heads * size])
        else:
            q, k, v = (ref(s) for s in sources)
            kv_heads = config.num_key_value_heads
        if kv_heads >= TP:
            return torch.cat(
                [q.chunk(TP, 0)[rank], k.chunk(TP, 0)[rank], v.chunk(TP, 0)[rank]]
            )
        head = rank * kv_heads // TP
        size = k.shape[0] // kv_heads
        return torch.cat(
            [
                q.chunk(TP, 0)[rank],
                k[head * size : (head + 1) * size],
                v[head * size : (head + 1) * size],
            ]
        )
    raise AssertionError(f"unexpected linear {kind} at {name}")


CONV1D: set[str] = set()  # names of the transformers Conv1D layers of the model


def _replicated_in_report(text: str) -> dict[str, set[str]]:
    """{class: attributes} the file's report says are whole on every rank ("*" for a
    class replicated whole)."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        found = re.match(
            r"#\s+Unfused: tensor parallel \((\w+)\): replicated(.*)", line
        )
        if found:
            cls, rest = found.groups()
            listed = re.match(r" on every rank: ([\w, ]+) \(", rest)
            out.setdefault(cls, set()).update(
                {a.strip() for a in listed.group(1).split(",")} if listed else {"*"}
            )
    return out


def _check_ranks(tmp_path, path: Path, model: str, causal: str, sharded_expected=True):
    source = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    hf_cls = getattr(source, causal)
    config = hf_cls.config_class(**tiny.working_values(hf_cls))
    ckpt = tmp_path / "ckpt"
    hf_model = tiny.build_checkpoint(hf_cls, config, ckpt)
    hf = hf_model.state_dict()
    from transformers.pytorch_utils import Conv1D

    from codemods.engine import body_bytes

    CONV1D.clear()
    CONV1D.update(n for n, m in hf_model.named_modules() if isinstance(m, Conv1D))
    whole_bytes = body_bytes(hf_model)
    mp.start_processes(
        _rank,
        args=(_free_port(), str(path), causal, str(ckpt), str(tmp_path)),
        nprocs=TP,
        start_method="spawn",
    )
    reported = _replicated_in_report(path.read_text())
    sharded = 0
    for rank in range(TP):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["linears"], "no vLLM linears"
        for name, (kind, weight, bias) in got["linears"].items():
            if kind not in ("ReplicatedLinear",):
                sharded += 1
            parts = got["parts"].get(name)
            want = _expected(kind, name, hf, got["packed"], rank, config, parts=parts)
            assert torch.equal(weight, want), (model, name, kind, rank)
            if bias is not None:
                want_b = _expected(
                    kind, name, hf, got["packed"], rank, config, "bias", parts
                )
                assert torch.equal(bias, want_b), (model, name, kind, rank, "bias")
        for name, value in got["sinks"].items():
            assert torch.equal(value, hf[name].chunk(TP, 0)[rank]), (model, name, rank)
        # a layer every rank holds whole is a slow path: the report must name it
        silent = {
            (cls, attr)
            for cls, attr in got["whole"]
            if not reported.get(cls, set()) & {attr, "*"}
        }
        assert not silent, f"replicated without a report line: {sorted(silent)}"
        share = got["bytes"] / whole_bytes
        if sharded_expected:
            assert share <= 0.6, (model, rank, share)
    assert sharded > 0


@pytest.mark.parametrize(
    "model,causal",
    [
        ("granite_swa", "GraniteSWAForCausalLM"),
        ("phi", "PhiForCausalLM"),
        ("afmoe", "AfmoeForCausalLM"),
        # no TP plan: the plan from the dataflow (Conv1D, a packed q|k|v; a decoder
        # layer holding its MLP's linears)
        ("gpt2", "GPT2LMHeadModel"),
        ("opt", "OPTForCausalLM"),
        # the out-projection built after the merged q/k/v block, which makes the head
        # count this rank's: its input is still the whole width
        ("nemotron", "NemotronForCausalLM"),
        # a packed [q; k; v] with one kv head, replicated on each rank; Falcon's grouped
        # layout divided with its held kv heads
        ("gpt_bigcode", "GPTBigCodeForCausalLM"),
        ("falcon", "FalconForCausalLM"),
    ],
)
def test_each_rank_holds_its_slice(tmp_path, model, causal):
    _check_ranks(tmp_path, REPO / "generated" / f"{model}.py", model, causal)


def test_a_silently_replicated_layer_fails(tmp_path):
    """Able to fail: OPT's q projection edited to `ReplicatedLinear` (its load and the
    numbers at TP=1 still fine) and its report line left out."""
    text = (REPO / "generated" / "opt.py").read_text()
    old = "self.q_proj = ColumnParallelLinear("
    assert text.count(old) == 1
    edited = tmp_path / "opt.py"
    anchor = "from vllm.model_executor.layers.linear import"
    edited.write_text(
        text.replace(old, "self.q_proj = ReplicatedLinear(").replace(
            anchor,
            f"{anchor} ReplicatedLinear\n{anchor}",
            1,
        )
    )
    with pytest.raises(AssertionError, match="replicated without a report line"):
        _check_ranks(tmp_path, edited, "opt", "OPTForCausalLM", sharded_expected=False)
