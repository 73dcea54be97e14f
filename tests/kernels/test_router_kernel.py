"""The fused MoE router (kernels/router.py): its reference is each model's routing, its CUDA body
compiles for sm_90, runs on the CPU under the threads emulator (test_gdn_kernel.py) with the
reference's results, and on the H200 (gpu tests)."""

from __future__ import annotations

import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from nvcc_check import assert_compiles, nvcc

from kapitsa.engine.kernels import backend, router
from tests.kernels.emulation import Emulated, cuda_host_translation


def _case(tokens, k, experts, extra, dtype, seed=0):
    keys = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((1, tokens, k), key=keys[0]).astype(dtype)
    w = (0.2 * mx.random.normal((experts + extra, k), key=keys[1])).astype(dtype)
    bias = 0.2 * mx.random.normal((experts,), key=keys[2])
    return x, w, bias


def _same(got, ref, *, rtol=2e-3) -> None:
    """Same experts per token (any order) with the same weights; same extra logits."""
    g_inds, g_w, g_extra = got
    r_inds, r_w, r_extra = ref
    order_g, order_r = mx.argsort(g_inds, axis=-1), mx.argsort(r_inds, axis=-1)
    assert mx.array_equal(mx.take_along_axis(g_inds, order_g, -1), mx.take_along_axis(r_inds, order_r, -1))
    gw, rw = mx.take_along_axis(g_w, order_g, -1), mx.take_along_axis(r_w, order_r, -1)
    assert mx.allclose(gw, rw, rtol=rtol, atol=1e-5).item(), float(mx.abs(gw - rw).max())
    assert (g_extra is None) == (r_extra is None)
    if g_extra is not None:
        ge, re_ = g_extra.astype(mx.float32), r_extra.astype(mx.float32)
        assert mx.allclose(ge, re_, rtol=1e-2, atol=1e-2).item(), float(mx.abs(ge - re_).max())


def test_reference_is_nemotrons_router() -> None:
    from kapitsa.engine.models import nemotron_h
    from kapitsa.testing.tiny import tiny_config

    args = nemotron_h.ModelArgs.from_dict(tiny_config("nemotron_h"))
    gate = nemotron_h.Router(args)
    x, w, bias = _case(3, args.hidden_size, args.n_routed_experts, 0, mx.float32)
    gate.weight, gate.e_score_correction_bias = w, bias
    want = gate(x)
    got = router.route_reference(
        x, w, experts=args.n_routed_experts, top_k=args.num_experts_per_tok, mode="sigmoid", bias=bias,
        normalize=args.norm_topk_prob, scale=args.routed_scaling_factor,
    )  # fmt: skip
    _same((got[0], got[1], None), (want[0], want[1], None), rtol=1e-6)


def test_reference_is_qwens_routing() -> None:
    """SparseMoe's own path (the op path it takes off CUDA) against the reference's pieces."""
    from kapitsa.engine.models import qwen3_5
    from kapitsa.testing.tiny import tiny_config

    args = qwen3_5.ModelArgs.from_dict(tiny_config("qwen3_5_moe"))
    moe = qwen3_5.SparseMoe(args)
    x, w, _ = _case(2, args.hidden_size, args.num_experts, 1, mx.float32)
    moe.gate.weight, moe.shared_expert_gate.weight = w[:-1], w[-1:]
    inds, scores, shared = moe.route(x)
    got = router.route_reference(
        x,
        w,
        experts=args.num_experts,
        top_k=args.num_experts_per_tok,
        mode="softmax",
        normalize=args.norm_topk_prob,
    )
    _same((inds, scores.astype(mx.float32), shared), got, rtol=1e-6)


def test_route_falls_back_to_the_reference_off_cuda() -> None:
    x, w, bias = _case(2, 64, 16, 0, mx.float32)
    kw = dict(experts=16, top_k=4, mode="sigmoid", bias=bias, scale=2.0)
    if backend() != "cuda":
        assert not router.supports(x, w, experts=16, top_k=4, bias=bias)
    _same(router.route(x, w, **kw), router.route_reference(x, w, **kw))


def test_bad_mode_is_a_clear_error() -> None:
    x, w, _ = _case(1, 64, 8, 0, mx.float32)
    with pytest.raises(ValueError, match="unknown router mode"):
        router.route_reference(x, w, experts=8, top_k=2, mode="relu")


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize(
    "dtype,k,experts,rows,top_k,mode",
    [
        (mx.bfloat16, 2048, 256, 257, 8, "softmax"),  # Qwen3.5-35B-A3B, shared gate fused
        (mx.bfloat16, 2688, 128, 128, 6, "sigmoid"),  # Nemotron-3-Nano-30B-A3B
        (mx.float32, 512, 40, 41, 4, "softmax"),
    ],
)
def test_cuda_source_compiles(dtype, k, experts, rows, top_k, mode) -> None:
    template = router._logits_template(dtype, dtype, k, rows, router.BLOCK)
    sources = [router._LOGITS.render([dtype, dtype], [mx.float32], template)]
    for wd in {mx.float32, dtype}:  # weights as float32, or in the model's dtype (Qwen's SparseMoe)
        template = router._select_template(dtype, experts, rows, top_k, mode, True, 2.5, wd)
        sources.append(router._SELECT.render([mx.float32, mx.float32], [mx.uint32, wd, dtype], template))
    gated = mode == "softmax" and rows > experts  # folded shared experts after the top k
    template = router._select_template(
        dtype, experts, rows, top_k, mode, True, 2.5, dtype, (experts, 2), gated
    )
    sources.append(router._SELECT.render([mx.float32, mx.float32], [mx.uint32, dtype, dtype], template))
    for source in sources:
        assert_compiles(source)


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "dtype,tokens,k,experts,extra,top_k,mode,normalize",
    [
        (mx.float32, 2, 64, 40, 1, 4, "softmax", True),
        (mx.bfloat16, 3, 128, 64, 0, 6, "sigmoid", True),
        (mx.float32, 1, 64, 33, 0, 8, "sigmoid", False),
        (mx.bfloat16, 2, 64, 70, 2, 3, "softmax", False),
    ],
)
def test_emulated_kernel_matches_reference(
    monkeypatch, tmp_path, dtype, tokens, k, experts, extra, top_k, mode, normalize
) -> None:
    monkeypatch.setattr(router, "_LOGITS", Emulated(router._LOGITS, cuda_host_translation, tmp_path))
    monkeypatch.setattr(router, "_SELECT", Emulated(router._SELECT, cuda_host_translation, tmp_path))
    x, w, bias = _case(tokens, k, experts, extra, dtype, seed=tokens)
    kw = dict(
        experts=experts,
        top_k=top_k,
        mode=mode,
        bias=bias if mode == "sigmoid" else None,
        normalize=normalize,
        scale=1.5,
    )
    with mx.stream(mx.cpu):
        got = router.route_kernel(x, w, block=64, **kw)
        ref = router.route_reference(x, w, **kw)
    _same(got, ref)


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize("mode", ["softmax", "sigmoid"])
def test_emulated_kernel_writes_weights_in_the_asked_dtype(monkeypatch, tmp_path, mode: str) -> None:
    """Weights asked in bfloat16 are the float32 weights rounded as `astype` rounds them, bit for
    bit: a model that multiplies in bfloat16 skips the cast and gets the same numbers."""
    monkeypatch.setattr(router, "_LOGITS", Emulated(router._LOGITS, cuda_host_translation, tmp_path))
    monkeypatch.setattr(router, "_SELECT", Emulated(router._SELECT, cuda_host_translation, tmp_path))
    x, w, bias = _case(2, 64, 40, 1, mx.bfloat16, seed=5)
    kw = dict(experts=40, top_k=4, mode=mode, bias=bias if mode == "sigmoid" else None, scale=1.5)
    with mx.stream(mx.cpu):
        wide = router.route_kernel(x, w, block=64, **kw)
        narrow = router.route_kernel(x, w, block=64, weights_dtype=mx.bfloat16, **kw)
        ref = router.route_reference(x, w, weights_dtype=mx.bfloat16, **kw)
    assert narrow[1].dtype == ref[1].dtype == mx.bfloat16 and wide[1].dtype == mx.float32
    assert mx.array_equal(narrow[0], wide[0])
    assert mx.array_equal(narrow[1], wide[1].astype(mx.bfloat16))
    _same(narrow, ref, rtol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs CUDA")
@pytest.mark.parametrize(
    "mode,experts,extra,top_k,shared",
    [
        ("softmax", 256, 1, 8, None),
        ("sigmoid", 128, 0, 6, None),
        ("softmax", 256, 1, 8, (256, 1)),  # Qwen3.5-35B-A3B with its shared expert folded
        ("sigmoid", 128, 0, 6, (128, 2)),  # Nemotron-3-Nano: a shared MLP of two experts' width
    ],
)
def test_gpu_matches_reference(mode, experts, extra, top_k, shared) -> None:
    x, w, bias = _case(4, 2048, experts, extra, mx.bfloat16)
    w = w / 10  # logits of ~1 (std 0.9), as a trained router's are, not ~10
    kw = dict(experts=experts, top_k=top_k, mode=mode, bias=bias if mode == "sigmoid" else None, scale=2.5)
    if shared is not None:
        kw.update(shared=shared, shared_gate=mode == "softmax", weights_dtype=mx.bfloat16)
    assert router.kernel_works()
    # Softmax mode rounds the logits to bf16 as the model's bf16 matmul does, but the kernel's
    # float32 sums run in another order than the matmul's, so a logit may round to the next bf16
    # step (2^-7 of it: 2% of a weight at a logit of ~2.5, 6% at logits of ~10, which is why the
    # test's logits stay small). Sigmoid mode sums in float32 on both sides.
    rtol = 2e-2 if mode == "softmax" else 2e-3
    _same(router.route_kernel(x, w, **kw), router.route_reference(x, w, **kw), rtol=rtol)


def test_module_is_plain_linear_only() -> None:
    """The kernel reads a plain weight matrix: quantized routers keep the op path."""
    layer = nn.Linear(64, 8, bias=False)
    assert router.plain_weight(layer) is layer.weight
    assert router.plain_weight(nn.QuantizedLinear(64, 8, bias=False)) is None
    assert router.plain_weight(nn.Linear(64, 8, bias=True)) is None


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "nemotron_moe"])
def test_models_route_through_the_kernel_when_on(monkeypatch, arch) -> None:
    """With the "route" family on and the kernel probed good (its reference standing in for it),
    a fused model's compiled decode takes the router kernel in every MoE layer and gives the same
    logits as with the family off."""
    from kapitsa.engine.loading.fuse import fuse_model
    from tests.models.builders import build_ours, logits_under_families

    calls = []

    def kernel(x, weight, **kw):
        calls.append(kw["mode"])
        return router.route_reference(x, weight, **kw)

    monkeypatch.setattr(router, "route_kernel", kernel)
    monkeypatch.setattr(router, "supports", lambda *a, **k: True)
    monkeypatch.setitem(router.WORKING, "router", True)
    model = build_ours(arch)
    fuse_model(model)

    plain = logits_under_families(model, monkeypatch, "gdn,moe,qmv,mamba")
    assert calls == []
    routed = logits_under_families(model, monkeypatch, "gdn,moe,qmv,mamba,route")
    moe_layers = sum(1 for _, m in model.named_modules() if type(m).__name__ in ("SparseMoe", "Router"))
    assert len(calls) >= moe_layers > 0
    assert set(calls) == {"softmax" if arch.startswith("qwen") else "sigmoid"}
    for a, b in zip(plain, routed, strict=True):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), float(mx.abs(a - b).max())


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "dtype,mode,extra,gated,count",
    [
        (mx.bfloat16, "softmax", 1, True, 2),  # Qwen: the shared expert's gate is the extra row
        (mx.float32, "softmax", 1, True, 1),
        (mx.bfloat16, "sigmoid", 0, False, 2),  # Nemotron: shared experts at weight 1
    ],
)
def test_emulated_kernel_appends_folded_shared_experts(
    monkeypatch, tmp_path, dtype, mode, extra, gated, count
) -> None:
    """With `shared=(first, count)` every row's top k are followed by the shared experts in order,
    at sigmoid(the gate row's logit) or 1, as the reference (the models' op path) appends them."""
    monkeypatch.setattr(router, "_LOGITS", Emulated(router._LOGITS, cuda_host_translation, tmp_path))
    monkeypatch.setattr(router, "_SELECT", Emulated(router._SELECT, cuda_host_translation, tmp_path))
    experts, top_k = 40, 4
    x, w, bias = _case(3, 64, experts, extra, dtype, seed=9)
    kw = dict(
        experts=experts, top_k=top_k, mode=mode, bias=bias if mode == "sigmoid" else None, scale=1.5,
        weights_dtype=dtype, shared=(experts, count), shared_gate=gated,
    )  # fmt: skip
    with mx.stream(mx.cpu):
        got = router.route_kernel(x, w, block=64, **kw)
        ref = router.route_reference(x, w, **kw)
    assert got[0].shape == got[1].shape == (1, 3, top_k + count)
    want_slots = mx.broadcast_to(mx.arange(experts, experts + count, dtype=mx.uint32), (1, 3, count))
    assert mx.array_equal(got[0][..., top_k:], want_slots)
    if not gated:
        assert mx.array_equal(got[1][..., top_k:], mx.ones((1, 3, count), dtype))
    _same(got, ref, rtol=1e-2 if dtype == mx.bfloat16 else 2e-3)


def test_supports_folded_slots_only_with_a_gate_row_where_gated() -> None:
    x, w, _ = _case(1, 64, 16, 0, mx.float32)
    if backend() != "cuda":
        pytest.skip("supports() answers False off CUDA")
    assert router.supports(x, w, experts=16, top_k=4, bias=None, shared=(16, 2))
    assert not router.supports(x, w, experts=16, top_k=4, bias=None, shared=(16, 2), shared_gate=True)
    assert not router.supports(x, w, experts=16, top_k=4, bias=None, shared=(16, router.MAX_SLOTS + 1))
