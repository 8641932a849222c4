"""A model's own eager attention (no attention interface) -> vLLM's paged `Attention`.

Older transformers models compute attention themselves: scores from a matmul of query
and key, a softmax, a matmul with the value, written inline in `forward` or in a helper
method (`self._attn(q, k, v, mask)`). The core is found in the source (a softmax between
two matmuls) and replaced by one call to vLLM's attention; what it computes is read
from the source's own tiny model, numbers first: the probe records the query, key,
value entering the core and the tensor leaving it on every layer, and the scale, the
causal window and ALiBi slopes are the ones under which vLLM's attention semantics give
that tensor. Doubt (no candidate reproduces it) refuses the model with the reason.
"""

from __future__ import annotations

import contextlib
import textwrap
from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from fusion_patterns.base import ClassInfo, code

from ..errors import CodemodError
from .attention import (
    TOLERANCE,
    AttentionSpec,
    _env,
    _config_param,
    _expression_for,
    _int_candidates,
    _HEAD_NAMES,
    _SIZE_NAMES,
    _atom,
    kv_heads_expression,
    reference,
)

_MATMUL_NAMES = {"matmul", "bmm", "baddbmm", "einsum"}


def _is_matmul(node) -> bool:
    if isinstance(node, cst.BinaryOperation) and isinstance(
        node.operator, cst.MatrixMultiply
    ):
        return True
    if isinstance(node, cst.Call):
        func = node.func
        name = (
            func.attr.value
            if isinstance(func, cst.Attribute)
            else getattr(func, "value", None)
        )
        return name in _MATMUL_NAMES
    return False


def _matmuls(node) -> list:
    return [
        n
        for n in m.findall(
            node, m.Call() | m.BinaryOperation(operator=m.MatrixMultiply())
        )
        if _is_matmul(n)
    ]


def _has_softmax(node) -> bool:
    for call in m.findall(node, m.Call()):
        func = call.func
        name = (
            func.attr.value
            if isinstance(func, cst.Attribute)
            else getattr(func, "value", None)
        )
        if name in ("softmax", "Softmax"):
            return True
        if isinstance(func, cst.Call) and m.matches(
            func.func, m.Attribute(attr=m.Name("Softmax"))
        ):
            return True
    return False


def _operands(node) -> list[cst.BaseExpression]:
    """The two tensor operands of a matmul-like node."""
    if isinstance(node, cst.BinaryOperation):
        return [node.left, node.right]
    kw = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
    pos = [a.value for a in node.args if a.keyword is None]
    name = (
        node.func.attr.value
        if isinstance(node.func, cst.Attribute)
        else node.func.value
    )
    if name == "baddbmm":
        if "batch1" in kw:
            return [kw["batch1"], kw["batch2"]]
        return (
            pos[-2:]
            if isinstance(node.func, cst.Attribute) and len(pos) == 2
            else pos[1:3]
        )
    return pos[:2]


def _base_name(expr) -> str | None:
    names = m.findall(expr, m.Name())
    skip = {"torch", "self", "nn", "F", "math"}
    for n in names:
        if n.value not in skip:
            return n.value
    return None


@dataclass
class Region:
    """Statements of forward from the scores' matmul to the output's (inclusive)."""

    start: cst.BaseStatement
    end: cst.BaseStatement
    q: str
    k: str
    v: str
    out: str


@dataclass
class EagerCore:
    kind: str  # "method": a helper called from forward; "inline": statements in forward
    method: str | None = None
    # inline: every attention core in forward (one per branch, as Falcon's alibi/rope)
    regions: list = None
    # the regions the tiny model ran (index into regions), set by the probe
    ran: set = None


def find(info: ClassInfo) -> EagerCore | None:
    """The attention core of a class that computes attention itself, if it has one."""
    if info.forward is None:
        return None
    methods = {
        s.name.value: s
        for s in info.node.body.body
        if isinstance(s, cst.FunctionDef)
        and s.name.value not in ("forward", "__init__")
    }
    for name, func in methods.items():
        if (
            _has_softmax(func)
            and len(_matmuls(func)) >= 2
            and m.findall(
                info.forward,
                m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name(name))),
            )
        ):
            return EagerCore(kind="method", method=name)
    regions = _inline(info.forward.body)
    return EagerCore(kind="inline", regions=regions, ran=set()) if regions else None


def _blocks(stmt) -> list:
    """The statement blocks directly inside an if/elif/else, for or with."""
    out = [stmt.body]
    orelse = getattr(stmt, "orelse", None)
    while isinstance(orelse, cst.If):
        out.append(orelse.body)
        orelse = orelse.orelse
    if isinstance(orelse, cst.Else):
        out.append(orelse.body)
    return out


def _inline(block) -> list:
    stmts = list(block.body) if hasattr(block, "body") else []
    found: list = []
    for i, stmt in enumerate(stmts):
        if isinstance(stmt, cst.If) or isinstance(stmt, (cst.For, cst.With)):
            inner = _blocks(stmt)
            nested = [r for b in inner for r in _inline(b)]
            # a softmax that is itself under an if (fp16 upcast) stays one statement
            if nested or not _has_softmax(stmt):
                found += nested
                continue
        if not _has_softmax(stmt):
            continue
        start = next((j for j in range(i, -1, -1) if _matmuls(stmts[j])), None)
        end = next((j for j in range(i + 1, len(stmts)) if _matmuls(stmts[j])), None)
        if start is None or end is None or start == i:
            continue
        first = _matmuls(stmts[start])[0]
        last = _matmuls(stmts[end])[0]
        q, k = (_base_name(o) for o in _operands(first))
        ops = _operands(last)
        v = _base_name(ops[1])
        target = stmts[end]
        if not m.matches(
            target,
            m.SimpleStatementLine([m.Assign(targets=[m.AssignTarget(m.Name())])]),
        ):
            continue
        out = target.body[0].targets[0].target.value
        if None in (q, k, v):
            continue
        found.append(Region(stmts[start], stmts[end], q, k, v, out))
    return found


# --- probe -------------------------------------------------------------------------


@contextlib.contextmanager
def instrumented(pymodule, cls, core: EagerCore, info: ClassInfo, sink: list):
    """Patch `cls` for one forward so every layer's core inputs and output are recorded."""
    import torch

    if core.kind == "method":
        original = getattr(cls, core.method)

        def recording(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            first = out[0] if isinstance(out, (tuple, list)) else out
            sink.append(
                dict(
                    module=self,
                    q=tensors[0].detach().clone(),
                    k=tensors[1].detach().clone(),
                    v=tensors[2].detach().clone(),
                    out=first.detach().clone(),
                    container=(
                        type(out).__name__ if isinstance(out, (tuple, list)) else None
                    ),
                    arity=len(out) if isinstance(out, (tuple, list)) else 1,
                )
            )
            return out

        setattr(cls, core.method, recording)
        try:
            yield
        finally:
            setattr(cls, core.method, original)
        return

    # inline: the forward re-compiled with recording calls around each core
    marks = {}
    for i, r in enumerate(core.regions):
        marks[id(r.start)] = (
            "enter",
            cst.parse_statement(f"__codemods_enter(self, {i}, {r.q}, {r.k}, {r.v})\n"),
        )
        marks[id(r.end)] = (
            "leave",
            cst.parse_statement(f"__codemods_leave(self, {i}, {r.out})\n"),
        )

    class _Wrap(cst.CSTTransformer):
        def leave_IndentedBlock(self, original, updated):
            out = []
            for old, new in zip(original.body, updated.body):
                mark = marks.get(id(old))
                if mark and mark[0] == "enter":
                    out.append(mark[1])
                out.append(new)
                if mark and mark[0] == "leave":
                    out.append(mark[1])
            return updated.with_changes(body=out)

    func = info.forward.with_changes(decorators=[]).visit(_Wrap())
    pending: dict[int, dict] = {}

    def enter_fn(self, region, q, k, v):
        pending[id(self)] = dict(
            module=self,
            region=region,
            q=q.detach().clone(),
            k=k.detach().clone(),
            v=v.detach().clone(),
        )

    def leave_fn(self, region, out):
        rec = pending.pop(id(self), None)
        if rec is not None:
            rec.update(out=out.detach().clone(), container=None, arity=1)
            core.ran.add(region)
            sink.append(rec)

    namespace = dict(vars(pymodule))
    namespace.update(__codemods_enter=enter_fn, __codemods_leave=leave_fn)
    exec(textwrap.dedent(code(func)), namespace)  # noqa: S102 - the source's own code
    original = cls.forward
    cls.forward = namespace["forward"]
    try:
        yield
    finally:
        cls.forward = original


# --- inference ---------------------------------------------------------------------


def _heads_layout(t, tokens: int):
    """[1, H, S, D] or [H, S, D] (batch 1, heads folded) -> [1, H, S, D]."""
    if t.dim() == 4 and t.shape[0] == 1:
        return t
    if t.dim() == 3:
        return t[None]
    return None


def infer(
    info: ClassInfo, core: EagerCore, records: list[dict], config, pymodule, tokens: int
):
    """The vLLM Attention arguments reproducing the source's own attention core."""
    if not records:
        raise CodemodError(
            f"cannot generate: the tiny model never runs {info.name}'s attention"
        )
    config_param = _config_param(info)
    cases = []
    key_transposed = None
    for rec in records:
        q, k, v, out = rec["q"], rec["k"], rec["v"], rec["out"]
        if q.shape[-2] != tokens:
            raise CodemodError(
                f"cannot generate: {info.name}'s attention query is shaped {list(q.shape)}, not [..., tokens, head size]"
            )
        transposed = k.shape[-1] == tokens and k.shape[-2] != tokens
        key_transposed = transposed if key_transposed is None else key_transposed
        if transposed:
            k = k.transpose(-1, -2)
        q4, k4, v4 = (_heads_layout(t, tokens) for t in (q, k, v))
        if q4 is None or k4 is None or v4 is None:
            raise CodemodError(
                f"cannot generate: {info.name}'s attention operands are shaped "
                f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)} (batch 1 expected)"
            )
        if out.shape[-2] == tokens and out.dim() in (3, 4):
            layout = "heads"
            o4 = out if out.dim() == 4 else out[None]
        elif out.dim() == 4 and out.shape[1] == tokens:
            layout = "tokens"
            o4 = out.transpose(1, 2)
        else:
            raise CodemodError(
                f"cannot generate: {info.name}'s attention core returns {list(out.shape)}"
            )
        cases.append((rec, q4, k4, v4, o4, layout, out.dim()))

    envs = [_env(_Call(c[0]["module"]), config, config_param, pymodule) for c in cases]
    heads = [c[1].shape[1] for c in cases]
    kv = [c[2].shape[1] for c in cases]
    size = [c[1].shape[-1] for c in cases]
    inst = cases[0][0]["module"]
    derived = []
    if config_param:
        derived = [
            f"{config_param}.hidden_size // {config_param}.num_attention_heads",
        ]
    heads_expr = _expression_for(
        _int_candidates(info, inst, config_param, _HEAD_NAMES), heads, envs
    )
    kv_expr = kv_heads_expression(info, inst, config_param, heads_expr, heads, kv, envs)
    size_expr = _expression_for(
        _int_candidates(info, inst, config_param, _SIZE_NAMES) + derived, size, envs
    )
    for what, expr, value in (
        ("head count", heads_expr, heads[0]),
        ("kv head count", kv_expr, kv[0]),
        ("head size", size_expr, size[0]),
    ):
        if expr is None:
            raise CodemodError(
                f"cannot generate: {info.name}: no attribute or config field holds its {what} ({value})"
            )

    # scales worth trying: the default, none, and the module's own numbers
    scale_candidates = [f"{_atom(size_expr)} ** -0.5", "1.0"]
    for attr in info.attrs:
        val = getattr(inst, attr, None)
        if isinstance(val, (int, float)) and not isinstance(val, bool) and val:
            scale_candidates += [f"self.{attr}", f"1 / self.{attr}"]
    windows_found: list = []
    scale_expr = alibi_expr = None
    for alibi_text in [None, *_alibi_candidates(heads_expr, config)]:
        for cand in scale_candidates:
            ok = True
            windows = []
            for (rec, q4, k4, v4, o4, _, _), env in zip(cases, envs):
                scale = _eval(cand, env)
                slopes = (
                    _eval(alibi_text, {**env, **ALIBI_FUNCTIONS})
                    if alibi_text
                    else None
                )
                if scale is None or (alibi_text and slopes is None):
                    ok = False
                    break
                w = _window_for(q4, k4, v4, o4, float(scale), tokens, slopes)
                if w is _NO:
                    ok = False
                    break
                windows.append(w)
            if ok:
                scale_expr, windows_found, alibi_expr = cand, windows, alibi_text
                break
        if scale_expr is not None:
            break
    if scale_expr is None:
        raise CodemodError(
            f"cannot generate: {info.name}'s own attention is not reproduced by vLLM's "
            "attention at any scale the module defines (causal, optionally windowed or ALiBi)"
        )
    window_expr = None
    if any(w is not None for w in windows_found):
        window_expr = _window_expression(
            info, inst, cases, envs, windows_found, config_param
        )
    spec = AttentionSpec(
        class_name=info.name,
        heads=heads_expr,
        kv_heads=kv_expr,
        head_size=size_expr,
        head_size_v=None,
        scale=scale_expr,
        window=window_expr,
        softcap=None,
        sinks=None,
        attr="attn" if "attn" not in info.attrs else "vllm_attn",
    )
    spec.eager = core
    spec.alibi = alibi_expr
    spec.key_transposed = bool(key_transposed)
    spec.out_layout = cases[0][5]
    spec.out_dims = cases[0][6]
    spec.container = records[0].get("container")
    spec.arity = records[0].get("arity", 1)
    from .attention import broadcast_from, head_count_attrs

    spec.broadcast = broadcast_from(info, inst, envs[0], config_param, kv[0])
    q_attrs, kv_attrs = head_count_attrs(
        info, inst, heads_expr, kv_expr, heads[0], kv[0]
    )
    spec.head_attrs, spec.kv_head_attrs = q_attrs + kv_attrs, kv_attrs
    return spec


# ALiBi slope families, as the sources compute them (vLLM's attention takes the slopes)
ALIBI_HELPERS = {
    "alibi_slopes": '''
def alibi_slopes(heads: int) -> list[float]:
    """ALiBi slopes as BLOOM/Falcon compute them (the closest power of two, then the
    odd powers of the next one for the remaining heads)."""
    closest = 2 ** math.floor(math.log2(heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** p for p in range(1, 1 + closest)]
    if closest != heads:
        extra = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** p for p in range(1, 1 + 2 * min(closest, heads - closest), 2)]
    return slopes
''',
    "alibi_slopes_mpt": '''
def alibi_slopes_mpt(heads: int, bias_max: float = 8) -> list[float]:
    """ALiBi slopes as MPT computes them (1 / 2^(i * bias_max / n) over the next power of
    two, the odd then even ones kept for a head count that is not one)."""
    n = 2 ** math.ceil(math.log2(heads))
    slopes = [1.0 / 2 ** (i * bias_max / n) for i in range(1, n + 1)]
    if n != heads:
        slopes = (slopes[1::2] + slopes[::2])[:heads]
    return slopes
''',
}


def _helper_functions() -> dict:
    import math as _math

    namespace = {"math": _math}
    for text in ALIBI_HELPERS.values():
        exec(text, namespace)  # noqa: S102 - our own helpers
    return {k: namespace[k] for k in ALIBI_HELPERS}


ALIBI_FUNCTIONS = _helper_functions()


def _alibi_candidates(heads_expr: str, config) -> list[str]:
    out = [f"alibi_slopes({heads_expr})", f"alibi_slopes_mpt({heads_expr})"]
    for owner, obj in [
        ("config", config),
        *[
            (f"config.{k}", v)
            for k, v in vars(config).items()
            if hasattr(v, "__dict__") and not k.startswith("_")
        ],
    ]:
        for k, v in vars(obj).items():
            if "alibi" in k and isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append(f"alibi_slopes_mpt({heads_expr}, {owner}.{k})")
    return out


class _Call:
    def __init__(self, module):
        self.module = module


def _eval(text: str, env: dict):
    try:
        return eval(text, dict(env))  # noqa: S307
    except Exception:
        return None


_NO = object()


def _window_for(q4, k4, v4, o4, scale: float, tokens: int, alibi=None):
    """None (causal) or the window under which vLLM's attention gives `o4`; _NO if none."""
    want = o4[0].transpose(0, 1).reshape(tokens, -1).float()
    ref = want.abs().max().item() or 1.0
    for window in [None, *range(1, tokens)]:
        got = reference(q4, k4, v4, scale, window, None, None, alibi)
        if (got - want).abs().max().item() / ref <= TOLERANCE:
            return window
    return _NO


def _window_expression(info, inst, cases, envs, windows, config_param) -> str:
    """An expression giving each layer's window: a config field for the windowed
    layers, chosen by an attribute that tells the layers apart."""
    sizes = {w for w in windows if w is not None}
    if len(sizes) != 1:
        raise CodemodError(
            f"cannot generate: {info.name} attends through several window sizes {sorted(sizes)}"
        )
    size = sizes.pop()
    field = None
    if config_param:
        for name, value in vars(envs[0][config_param]).items():
            if (
                isinstance(value, int)
                and not isinstance(value, bool)
                and value == size
                and "window" in name
            ):
                field = f"{config_param}.{name}"
                break
    if field is None:
        raise CodemodError(
            f"cannot generate: no config field holds {info.name}'s window {size}"
        )
    if all(w is not None for w in windows):
        return field
    for attr in info.attrs:
        vals = [getattr(c[0]["module"], attr, None) for c in cases]
        if not all(isinstance(v, (str, bool, int)) for v in vals):
            continue
        windowed = {v for v, w in zip(vals, windows) if w is not None}
        full = {v for v, w in zip(vals, windows) if w is None}
        if len(windowed) == 1 and not windowed & full:
            value = windowed.pop()
            return f"{field} if self.{attr} == {value!r} else None"
    raise CodemodError(
        f"cannot generate: no attribute of {info.name} tells its windowed layers from the others"
    )


# --- rewrite -----------------------------------------------------------------------

HELPER = '''
def vllm_attention_heads(attn: Attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_transposed: bool = False) -> torch.Tensor:
    """A model's own attention core on vLLM's paged attention: query, key and value
    as the source holds them ([1, heads, tokens, head size], or heads folded into the
    batch; the key possibly transposed), out as [1, heads, tokens, head size]."""
    if key_transposed:
        key = key.transpose(-1, -2)
    tokens, size_v = query.shape[-2], value.shape[-1]
    if size_v < query.shape[-1]:  # a smaller value head: padded, as vLLM stores one size
        value = nn.functional.pad(value, (0, query.shape[-1] - size_v))
    flat = [t.reshape(-1, tokens, t.shape[-1]).transpose(0, 1).reshape(tokens, -1) for t in (query, key, value)]
    out = attn(*flat)
    return out.view(tokens, -1, query.shape[-1])[..., :size_v].transpose(0, 1)[None]
'''


def replacement(spec, q: str, k: str, v: str) -> str:
    call = f"vllm_attention_heads(self.{spec.attr}, {q}, {k}, {v}" + (
        ", key_transposed=True)" if spec.key_transposed else ")"
    )
    if spec.out_layout == "tokens":
        call += ".transpose(1, 2)"
    elif spec.out_dims == 3:
        call += "[0]"
    return call


class CoreRewrite(cst.CSTTransformer):
    """The core -> one vLLM attention call; names the core computed for later use
    (the attention weights) become None."""

    def __init__(self, spec, used_after: set[str] | None = None):
        self.spec = spec
        self.core = spec.eager
        self.outside_loads: dict[int, set[str]] = {}

    def visit_FunctionDef(self, node: cst.FunctionDef):
        from .simplify import loads

        if self.core.kind != "inline" or node.name.value != "forward":
            return True
        for index, region in enumerate(self.core.regions):
            inside = set()
            # loads of the whole forward minus the region's own statements
            blocks = [
                b for b in m.findall(node, m.IndentedBlock()) if region.start in b.body
            ]
            if not blocks:
                continue
            stmts = list(blocks[0].body)
            i, j = stmts.index(region.start), stmts.index(region.end)
            for s in stmts[i : j + 1]:
                inside |= {id(n) for n in m.findall(s, m.Name())}
            skip = {id(x) for x in m.findall(node, m.Name())} - {
                id(x) for x in m.findall(node.body, m.Name())
            }
            reads = set()
            for name in m.findall(node.body, m.Name()):
                if id(name) not in inside and id(name) not in skip:
                    reads.add(name.value)
            self.outside_loads[index] = reads & set(loads(node.body))
        return True

    def leave_Call(self, original, updated: cst.Call):
        core = self.core
        if core.kind != "method" or not m.matches(
            updated.func, m.Attribute(value=m.Name("self"), attr=m.Name(core.method))
        ):
            return updated
        q, k, v = (code(a.value) for a in updated.args[:3])
        call = replacement(self.spec, q, k, v)
        if self.spec.container == "list":
            return cst.parse_expression(f"[{call}]")
        if self.spec.container == "tuple":
            nones = ", None" * (self.spec.arity - 1)
            return cst.parse_expression(
                f"({call}{nones},)" if self.spec.arity == 1 else f"({call}{nones})"
            )
        return cst.parse_expression(call)

    def leave_IndentedBlock(self, original, updated):
        from .simplify import stores

        core = self.core
        if core.kind != "inline":
            return updated
        originals = list(original.body)
        body = list(updated.body)
        # last region first, so earlier indices hold
        for index in reversed(range(len(core.regions))):
            region = core.regions[index]
            if region.start not in originals:
                continue
            i, j = originals.index(region.start), originals.index(region.end)
            if index not in core.ran:
                # a branch the tiny model never took is not proven: say so when it runs
                stmt = cst.parse_statement(
                    f'raise NotImplementedError("{self.spec.class_name}: this attention '
                    "branch was not exercised when the file was generated, so it is not "
                    'proven; regenerate with a config that takes it")\n'
                )
                body[i:] = [stmt]  # what follows in the branch is unreachable
                continue
            defined = set()
            for s in originals[i : j + 1]:
                defined |= stores(s)
            defined.discard(region.out)
            # names the core computed that the rest of forward reads (the weights)
            later = set(self.outside_loads.get(index, ()))
            stmt = cst.parse_statement(
                f"{region.out} = {replacement(self.spec, region.q, region.k, region.v)}\n"
            )
            nones = [
                cst.parse_statement(f"{n} = None\n") for n in sorted(defined & later)
            ]
            body[i : j + 1] = [stmt, *nones]
        return updated.with_changes(body=body)
