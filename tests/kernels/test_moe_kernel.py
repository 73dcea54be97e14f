"""MoE decode kernels (kapitsa/engine/kernels/moe.py) against their reference and the model path.

On CPU: the reference equals what SwitchGLU / SwitchReluSquared + score weighting + sum compute;
a NumPy transcription of the two kernels' algorithm (pair grouping by expert, 16-byte chunk
unpacking, scale/bias per group, summed scores of repeated experts) equals the reference; the host
logic (shape errors, supports, fallback, module extraction) runs for real; every CUDA variant we
launch compiles with nvcc. The kernels themselves run under the `gpu` / `metal` markers.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from nvcc_check import assert_compiles, nvcc

from kapitsa.engine.kernels import backend, moe, moe_launch
from kapitsa.engine.kernels.moe import QuantStack, experts_decode, experts_decode_reference
from kapitsa.engine.ops.moe import QuantizedSwitchLinear, SwitchGLU, SwitchReluSquared
from kapitsa.errors import KapitsaError


def _quantize_module(module, group_size: int, bits: int):
    for name, child in module.children().items():
        setattr(module, name, QuantizedSwitchLinear.from_switch_linear(child, group_size, bits, "affine"))
    return module


def _stacks(module) -> tuple[str, tuple[QuantStack, ...], QuantStack, int, int]:
    found = moe.module_stacks(module)
    assert found is not None
    return found


def _routing(tokens: int, k: int, experts: int, seed: int, pool: int | None = None):
    """Distinct experts per token (as top-k gives), drawn from a random subset of `pool` experts
    (always including the last one) to force sharing between tokens."""
    rng = np.random.default_rng(seed)
    chosen = np.concatenate([[experts - 1], rng.permutation(experts - 1)[: (pool or experts) - 1]])
    idx = np.stack([rng.choice(chosen, size=k, replace=False) for _ in range(tokens)]).astype(np.uint32)
    scores = rng.random((tokens, k)).astype(np.float32)
    return mx.array(idx), mx.array(scores / scores.sum(-1, keepdims=True))


def _module_path(module, x, idx, scores):
    """The models' code today: experts per slot, weighted, summed over slots."""
    return (module(x, idx) * scores[..., None]).sum(axis=-2).astype(x.dtype)


@pytest.mark.parametrize("kind", moe.KINDS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("tokens", [1, 3, 10])  # 10 x 8 = 80 pairs: the module's sorted path
def test_reference_is_the_module_path(kind: str, dtype, tokens: int) -> None:
    mx.random.seed(0)
    d, hidden, experts, k = 64, 32, 12, 8 if kind == "swiglu" else 6
    module = SwitchGLU(d, hidden, experts) if kind == "swiglu" else SwitchReluSquared(d, hidden, experts)
    module = _quantize_module(module, 32, 4)
    module.set_dtype(dtype)
    kind_, first, second, gs, bits = _stacks(module)
    x = mx.random.normal((tokens, d)).astype(dtype)
    idx, scores = _routing(tokens, k, experts, seed=tokens)
    if dtype == mx.bfloat16:
        scores = scores.astype(dtype)  # Qwen's SparseMoe weights in x's dtype
    want = _module_path(module, x, idx, scores)
    got = experts_decode_reference(x, idx, scores, first, second, kind=kind_, group_size=gs, bits=bits)
    assert got.dtype == dtype and got.shape == (tokens, d)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), atol=tol)
    # The drop-in the models call falls back to exactly the module path here (no GPU backend).
    routed = moe.routed_experts(module, x[None], idx[None], scores[None])
    assert routed.shape == (1, tokens, d)
    if backend() is None:
        assert mx.array_equal(routed[0], want)


# --- NumPy transcription of the kernels -------------------------------------------------------


def _expert_rows(stack: QuantStack, e: int, vectors: np.ndarray, bits: int, gs: int) -> np.ndarray:
    """W[e] @ v for each vector v, the kernels' way: per 16-byte chunk, unpack VPC values from
    four words (value j in word j // (32/bits) at bit (j % (32/bits)) * bits), then
    scale * dot(q, v) + bias * sum(v) with the chunk's group."""
    vpc, per_word = 128 // bits, 32 // bits
    words = np.array(stack.weight[e]).reshape(stack.weight.shape[1], -1, 4).astype(np.uint64)  # [N, C, 4]
    j = np.arange(vpc)
    q = (words[..., j // per_word] >> (j % per_word * bits).astype(np.uint64)) & ((1 << bits) - 1)
    group = np.arange(words.shape[1]) * vpc // gs  # [C]
    scale = np.array(stack.scales[e].astype(mx.float32))[:, group]  # [N, C]
    bias = np.array(stack.biases[e].astype(mx.float32))[:, group]
    v = vectors.reshape(len(vectors), -1, vpc)  # [V, C, VPC]
    dot = np.einsum("ncj,vcj->vnc", q.astype(np.float64), v)
    return (scale * dot + bias * v.sum(-1)[:, None, :]).sum(-1)  # [V, N]


def _emulate_hidden(x, idx, stacks, kind, experts, bits, gs) -> np.ndarray:
    """Kernel 1: the block of the first pair routed to e serves every token routed to e (its first
    slot with e); unknown experts write zeros. Rows nobody writes stay NaN (uninitialised)."""
    tokens, k = idx.shape
    flat = idx.reshape(-1)
    h = np.full((tokens * k, stacks[0].weight.shape[1]), np.nan)
    for p, e in enumerate(flat):
        if (flat[:p] == e).any():
            continue
        members = [(m, m * k + int(np.argmax(idx[m] == e))) for m in range(tokens) if (idx[m] == e).any()]
        pairs = [pair for _, pair in members]
        if not 0 <= e < experts:
            h[pairs] = 0.0
            continue
        acts = [_expert_rows(s, int(e), x[[m for m, _ in members]], bits, gs) for s in stacks]
        h[pairs] = (
            acts[0] / (1 + np.exp(-acts[0])) * acts[1] if kind == "swiglu" else np.maximum(acts[0], 0) ** 2
        )
    return h


def _emulate_out(h, idx, scores, second, experts, bits, gs) -> np.ndarray:
    """Kernel 2: walk the distinct known experts; token m's first slot with e supplies h, its
    scores for e are summed."""
    tokens, k = idx.shape
    flat = idx.reshape(-1)
    y = np.zeros((tokens, second.weight.shape[1]))
    for p, e in enumerate(flat):
        if (flat[:p] == e).any() or not 0 <= e < experts:
            continue
        for m in range(tokens):
            hit = idx[m] == e
            if hit.any():
                first = m * k + int(np.argmax(hit))
                y[m] += scores[m][hit].sum() * _expert_rows(second, int(e), h[first][None], bits, gs)[0]
    return y


@pytest.mark.parametrize("kind", moe.KINDS)
@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 64), (8, 64), (8, 128)])
def test_kernel_algorithm_matches_reference(kind: str, bits: int, gs: int) -> None:
    mx.random.seed(1)
    tokens, k, experts, d, hidden = 4, 3, 6, 128, 128
    module = SwitchGLU(d, hidden, experts) if kind == "swiglu" else SwitchReluSquared(d, hidden, experts)
    kind_, first, second, _, _ = _stacks(_quantize_module(module, gs, bits))
    x = mx.random.normal((tokens, d))
    idx, scores = _routing(tokens, k, experts, seed=bits + gs, pool=4)  # heavy sharing between tokens
    want = experts_decode_reference(x, idx, scores, first, second, kind=kind_, group_size=gs, bits=bits)
    xn, idxn, scn = np.array(x).astype(np.float64), np.array(idx).astype(np.int64), np.array(scores)
    h = _emulate_hidden(xn, idxn, first, kind, experts, bits, gs)
    got = _emulate_out(h, idxn, scn, second, experts, bits, gs)
    np.testing.assert_allclose(got, np.array(want), rtol=1e-4, atol=1e-4)


def test_kernel_algorithm_repeated_and_unknown_experts() -> None:
    """A token listing an expert twice gets both scores (as the gather does); an index past E
    contributes nothing instead of reading out of bounds."""
    mx.random.seed(2)
    d, hidden, experts, bits, gs = 64, 32, 4, 4, 32
    _, first, second, _, _ = _stacks(_quantize_module(SwitchGLU(d, hidden, experts), gs, bits))
    x = mx.random.normal((2, d))
    idx = mx.array([[1, 1, 2], [2, 0, 1]], dtype=mx.uint32)
    scores = mx.array([[0.5, 0.25, 0.25], [0.2, 0.3, 0.5]])
    want = experts_decode_reference(x, idx, scores, first, second, kind="swiglu", group_size=gs, bits=bits)
    xn, idxn, scn = np.array(x).astype(np.float64), np.array(idx).astype(np.int64), np.array(scores)
    got = _emulate_out(
        _emulate_hidden(xn, idxn, first, "swiglu", experts, bits, gs), idxn, scn, second, experts, bits, gs
    )
    np.testing.assert_allclose(got, np.array(want), rtol=1e-4, atol=1e-4)
    bad = idxn.copy()
    bad[0, 2] = experts + 3  # unknown expert: only the pair's own term disappears
    keep = np.array(scores) * (bad < experts)
    got_bad = _emulate_out(
        _emulate_hidden(xn, bad, first, "swiglu", experts, bits, gs), bad, keep, second, experts, bits, gs
    )
    want_bad = experts_decode_reference(
        x, idx, mx.array(keep), first, second, kind="swiglu", group_size=gs, bits=bits
    )
    np.testing.assert_allclose(got_bad, np.array(want_bad), rtol=1e-4, atol=1e-4)


# --- host logic --------------------------------------------------------------------------------


def _small(kind: str = "swiglu", bits: int = 4, gs: int = 32):
    mx.random.seed(3)
    module = SwitchGLU(64, 32, 8) if kind == "swiglu" else SwitchReluSquared(64, 32, 8)
    _, first, second, _, _ = _stacks(_quantize_module(module, gs, bits))
    return first, second


def test_falls_back_to_reference_off_gpu() -> None:
    first, second = _small()
    x = mx.random.normal((2, 64))
    idx, scores = _routing(2, 4, 8, seed=4)
    args = dict(kind="swiglu", group_size=32, bits=4)
    if backend() is None:
        assert not moe.supports(x, idx, group_size=32, bits=4)
        assert mx.array_equal(
            experts_decode(x, idx, scores, first, second, **args),
            experts_decode_reference(x, idx, scores, first, second, **args),
        )


def test_supports_routes_only_small_affine_batches(monkeypatch) -> None:
    monkeypatch.setattr(moe, "backend", lambda: "cuda")
    x1, x8, x9 = (mx.zeros((m, 2048), mx.bfloat16) for m in (1, 8, 9))
    idx = {m: mx.zeros((m, 9), mx.uint32) for m in (1, 8, 9)}  # top-8 + a folded shared expert
    assert moe.supports(x1, idx[1], group_size=64, bits=4)
    assert moe.supports(x8, idx[8], group_size=128, bits=8)  # 72 pairs: the limit
    assert not moe.supports(x9, idx[9], group_size=64, bits=4)  # 81 pairs: gather_qmm
    assert not moe.supports(x8, idx[8], group_size=64, bits=4, max_pairs=71)  # a model's lower limit
    assert not moe.supports(x9, idx[9], group_size=64, bits=4, max_pairs=200)  # never past the kernels'
    assert moe.supports(x1, idx[1], group_size=64, bits=4, max_pairs=9)
    assert not moe.supports(x1, idx[1], group_size=64, bits=6)
    assert not moe.supports(x1, idx[1], group_size=16, bits=4)
    assert not moe.supports(x1, idx[1].astype(mx.int64), group_size=64, bits=4)
    assert not moe.supports(mx.zeros((17, 2048)), mx.zeros((17, 2), mx.uint32), group_size=64, bits=4)
    assert moe.supports(mx.zeros((1, 1, 2048)), mx.zeros((1, 1, 8), mx.int32), group_size=64, bits=4)
    monkeypatch.setattr(moe, "backend", lambda: None)
    assert not moe.supports(x1, idx[1], group_size=64, bits=4)


def test_module_stacks_rejects_what_the_kernels_cannot_read() -> None:
    assert moe.module_stacks(SwitchGLU(64, 32, 4)) is None  # not quantized
    assert moe.module_stacks(_quantize_module(SwitchReluSquared(64, 32, 4, bias=True), 32, 4)) is None
    mixed = _quantize_module(SwitchGLU(64, 32, 4), 32, 4)
    mixed.down_proj = QuantizedSwitchLinear.from_switch_linear(
        SwitchGLU(64, 32, 4).down_proj, 32, 8, "affine"
    )
    assert moe.module_stacks(mixed) is None
    kind, first, second, gs, bits = _stacks(_quantize_module(SwitchGLU(64, 64, 4), 64, 8))
    assert (kind, len(first), gs, bits) == ("swiglu", 2, 64, 8)


def test_module_stacks_follow_new_weights() -> None:
    """The stacks are cached on the module, and re-read once any of its arrays is replaced."""
    module = _quantize_module(SwitchGLU(64, 64, 4), 64, 4)
    first = moe.module_stacks(module)
    assert moe.module_stacks(module)[2].weight is first[2].weight
    module.down_proj.weight = mx.array(module.down_proj.weight)
    assert moe.module_stacks(module)[2].weight is module.down_proj.weight
    module.down_proj = QuantizedSwitchLinear.from_switch_linear(
        SwitchGLU(64, 64, 4).down_proj, 64, 8, "affine"
    )
    assert moe.module_stacks(module) is None  # now mixed formats: the module path


def _raises(match: str, *args, **kwargs) -> None:
    with pytest.raises(KapitsaError, match=match):
        experts_decode(*args, **kwargs)


def test_bad_shapes_raise_clear_errors() -> None:
    first, second = _small()
    x, (idx, scores) = mx.random.normal((2, 64)), _routing(2, 4, 8, seed=5)
    ok = dict(kind="swiglu", group_size=32, bits=4)
    _raises("kind must be one of", x, idx, scores, first, second, **{**ok, "kind": "gelu"})
    _raises("takes first", x, idx, scores, first[0], second, **ok)
    _raises("takes first", x, idx, scores, first, second, **{**ok, "kind": "relu2"})
    _raises("bits", x, idx, scores, first, second, **{**ok, "bits": 6})
    _raises("same leading shape", x, idx[:1], scores[:1], first, second, **ok)
    _raises("same leading shape", x, idx, scores[:, :2], first, second, **ok)
    _raises("features", mx.random.normal((2, 32)), idx, scores, first, second, **ok)
    _raises("scales must be", x, idx, scores, first, second, **{**ok, "group_size": 64})
    _raises("need first", x, idx, scores, first, first[0], **ok)
    _raises("gate and up", x, idx, scores, (first[0], second), second, **ok)
    broken = QuantStack(first[0].weight, first[0].scales[:, :-1], first[0].biases)
    _raises("first scales", x, idx, scores, (broken, first[1]), second, **ok)
    _raises("uint32", x, idx, scores, first, QuantStack(second.scales, second.scales, second.biases), **ok)


# --- nvcc: every variant the launcher builds ---------------------------------------------------

REAL_SHAPES = {  # kind: (experts, k, in dims, hidden, out dims)
    "swiglu": (256, 8, 2048, 512, 2048),  # Qwen3.5-35B-A3B
    "relu2": (128, 6, 2688, 1856, 2688),  # Nemotron-3-Nano-30B-A3B
}


def _cases(kind: str, full: bool):
    """(activation dtype, bits, index dtype, scores dtype, tokens) to compile: every dtype and bits
    at one token plus the largest token count; `full` adds every index/scores dtype pairing."""
    k = REAL_SHAPES[kind][1]
    for dt in moe.ACT_DTYPES:
        for bits in moe.BITS:
            yield dt, bits, mx.uint32, mx.float32, 1
            yield from [(dt, bits, mx.int32, dt, 1), (dt, bits, mx.int32, dt, 4)] if full else []
            if full or dt == mx.bfloat16:
                yield dt, bits, mx.uint32, dt, moe.MAX_PAIRS // k


def _variants(kind: str, which: str, full: bool) -> str:
    """One translation unit with the kernel rendered for each case (renamed so they can share it)."""
    experts, k, d, hidden, d_out = REAL_SHAPES[kind]
    nw = 2 if kind == "swiglu" else 1
    parts = []
    for n, (dt, bits, idt, sct, tokens) in enumerate(_cases(kind, full)):
        plan = moe_launch.Plan(tokens, k, experts, d, hidden, d_out, bits, 64, kind)
        if which == "hidden":
            kernel = moe_launch.hidden_kernel(kind)
            ins = [dt, idt] + [mx.uint32, dt, dt] * nw
            template, out = plan.hidden_template(dt, dt, idt), [mx.float32]
        else:
            kernel = moe_launch.OUT_KERNEL
            ins = [mx.float32, idt, sct, mx.uint32, dt, dt]
            template, out = plan.out_template(dt, dt, idt, sct), [dt]
        parts.append(dataclasses.replace(kernel, name=f"{kernel.name}_{n}").render(ins, out, template))
    return "\n".join(parts)


def _compiles(kind: str, which: str, full: bool) -> None:
    assert_compiles(_variants(kind, which, full))


@pytest.mark.skipif(nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("kind", moe.KINDS)
@pytest.mark.parametrize("which", ["hidden", "out"])
def test_cuda_variants_compile(kind: str, which: str) -> None:
    _compiles(kind, which, full=False)


@pytest.mark.slow
@pytest.mark.skipif(nvcc() is None, reason="nvcc not installed")
@pytest.mark.parametrize("kind", moe.KINDS)
@pytest.mark.parametrize("which", ["hidden", "out"])
def test_cuda_all_variants_compile(kind: str, which: str) -> None:
    _compiles(kind, which, full=True)


@pytest.mark.parametrize("kind", moe.KINDS)
@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_launch_geometry_fits_shared_memory(kind: str, tokens: int) -> None:
    experts, k, d, hidden, d_out = REAL_SHAPES[kind]
    for bits in moe.BITS:
        plan = moe_launch.Plan(
            tokens, min(k, moe.MAX_PAIRS // tokens), experts, d, hidden, d_out, bits, 64, kind
        )
        for template, staged, static in (
            (
                plan.hidden_template(mx.bfloat16, mx.bfloat16, mx.uint32),
                plan.tokens,
                plan.hidden_static_bytes,
            ),
            (
                plan.out_template(mx.bfloat16, mx.bfloat16, mx.uint32, mx.float32),
                plan.pairs,
                plan.out_static_bytes,
            ),
        ):
            t = dict(template)
            assert t["TILE"] % 32 == 0 and t["TILE"] >= 32
            assert plan.shared_bytes(template, staged) + static <= 48 * 1024
            assert (t["TILE"] // (128 // bits)) >= t["LPR"]


# --- on the device -----------------------------------------------------------------------------


def _real_case(kind: str, bits: int, dtype, tokens: int, *, n_in: int | None = None, seed: int = 0):
    experts, k, d, hidden, d_out = REAL_SHAPES[kind]
    d = d_out = n_in or d
    mx.random.seed(seed)

    def stack(n_out, n_in_):
        w = (mx.random.normal((experts, n_out, n_in_)) * 0.02).astype(dtype)
        return QuantStack(*mx.quantize(w, group_size=64, bits=bits))

    first = (stack(hidden, d), stack(hidden, d)) if kind == "swiglu" else stack(hidden, d)
    second = stack(d_out, hidden)
    x = mx.random.normal((tokens, d)).astype(dtype)
    idx, scores = _routing(tokens, k, experts, seed=seed, pool=max(k, 2 * k * tokens // 3))
    return x, idx, scores, first, second


def _rel_err(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    return float(mx.abs(got - want).max()) / max(float(mx.abs(want).max()), 1e-6)


def _f32(stack) -> QuantStack:
    return QuantStack(stack.weight, stack.scales.astype(mx.float32), stack.biases.astype(mx.float32))


def _check_against_references(got, x, idx, scores, first, second, args) -> None:
    """The kernels accumulate in float32 and keep h in float32: within output rounding of the
    reference run in float32 on the same quantized weights; and close to the reference in x's
    dtype (what the models compute today, which rounds h and every slot's output)."""
    first32 = _f32(first) if isinstance(first, QuantStack) else tuple(_f32(f) for f in first)
    with mx.stream(mx.cpu):  # exact float32 products (a GPU's float32 matmul may round to TF32)
        exact = experts_decode_reference(
            x.astype(mx.float32), idx, scores.astype(mx.float32), first32, _f32(second), **args
        )
        mx.eval(exact)
    err = _rel_err(got, exact)
    assert err < (1e-2 if x.dtype != mx.float32 else 1e-3), err
    if x.dtype != mx.float32:
        as_today = experts_decode_reference(x, idx, scores, first, second, **args)
        assert _rel_err(got, as_today) < 1e-1, _rel_err(got, as_today)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", moe.KINDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_cuda_kernel_matches_reference(kind: str, bits: int, dtype, tokens: int) -> None:
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    x, idx, scores, first, second = _real_case(kind, bits, dtype, tokens, seed=tokens)
    args = dict(kind=kind, group_size=64, bits=bits)
    assert moe.supports(x, idx, group_size=64, bits=bits)
    got = experts_decode(x, idx, scores, first, second, **args)
    assert got.dtype == dtype and got.shape == x.shape
    _check_against_references(got, x, idx, scores, first, second, args)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4])
def test_cuda_latent_moe_matches_reference(tokens: int) -> None:
    """Nemotron latent MoE: the routed experts run in the latent size (1024 here)."""
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    x, idx, scores, first, second = _real_case("relu2", 4, mx.bfloat16, tokens, n_in=1024)
    args = dict(kind="relu2", group_size=64, bits=4)
    got = experts_decode(x, idx, scores, first, second, **args)
    _check_against_references(got, x, idx, scores, first, second, args)


@pytest.mark.gpu
def test_cuda_routed_experts_matches_module() -> None:
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    mx.random.seed(7)
    module = _quantize_module(SwitchGLU(2048, 512, 64), 64, 4)
    module.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 2, 2048)).astype(mx.bfloat16)
    idx, scores = _routing(2, 8, 64, seed=7)
    got = moe.routed_experts(module, x, idx[None], scores[None].astype(mx.bfloat16))
    want = _module_path(module, x, idx[None], scores[None].astype(mx.bfloat16))
    assert _rel_err(got, want) < 1e-1, _rel_err(got, want)
    kind, first, second, gs, bits = moe.module_stacks(module)
    args = dict(kind=kind, group_size=gs, bits=bits)
    _check_against_references(got[0], x[0], idx, scores.astype(mx.bfloat16), first, second, args)


@pytest.mark.metal
@pytest.mark.parametrize("kind", moe.KINDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 4])
def test_metal_kernel_matches_reference(kind: str, bits: int, tokens: int) -> None:
    if backend() != "metal":
        pytest.skip("needs the Metal backend")
    x, idx, scores, first, second = _real_case(kind, bits, mx.bfloat16, tokens, seed=tokens)
    args = dict(kind=kind, group_size=64, bits=bits)
    got = experts_decode(x, idx, scores, first, second, **args)
    _check_against_references(got, x, idx, scores, first, second, args)
