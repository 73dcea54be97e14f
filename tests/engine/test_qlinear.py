"""RoutedQuantizedLinear: same layer, product routed by input rows (kernel / dequant / stock)."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import pytest

from kapitsa.engine.kernels.matvec import qmv_reference
from kapitsa.engine.kernels.matvec_one_row import qmv_one_row_reference
from kapitsa.engine.ops import linear as qlinear
from kapitsa.engine.options import FUSED_PARTS, KernelOptions

DEFAULTS = KernelOptions()
EVERY_PART = KernelOptions(fused_parts=frozenset(FUSED_PARTS))


def _model(bits: int = 4, bias: bool = False) -> nn.Module:
    mx.random.seed(0)
    model = nn.Sequential(nn.Linear(128, 64, bias=bias), nn.Linear(64, 32, bias=bias))
    nn.quantize(model, group_size=64, bits=bits)
    return model


def test_reclassing_keeps_parameters_and_is_idempotent() -> None:
    model = _model()
    before = dict(nn.utils.tree_flatten(model.parameters()))
    assert qlinear.route_quantized_linears(model, DEFAULTS) == 2
    assert qlinear.route_quantized_linears(model, DEFAULTS) == 0
    assert all(type(m) is qlinear.RoutedQuantizedLinear for m in model.layers)
    after = dict(nn.utils.tree_flatten(model.parameters()))
    assert before.keys() == after.keys() and all(mx.array_equal(before[k], after[k]).item() for k in before)


def test_off_cuda_it_is_the_stock_layer(on_cpu) -> None:
    model = _model()
    x = mx.random.normal((3, 128))
    ref = model(x)
    qlinear.route_quantized_linears(model, DEFAULTS)
    assert not qlinear.routes_enabled(DEFAULTS)
    assert mx.array_equal(model(x), ref).item()


@pytest.fixture
def forced(monkeypatch, on_cpu) -> list:
    """Routes on (as on CUDA) with the general kernel probed good and replaced by its reference;
    records the kernel calls."""
    calls = []

    def kernel(name, x, w, scales, biases, group_size, bits):
        calls.append((name, x.shape))
        return qmv_reference(x, w, scales, biases, group_size=group_size, bits=bits)

    monkeypatch.setattr(qlinear, "routes_enabled", lambda options: True)
    monkeypatch.setattr(qlinear, "_kernel_call", kernel)
    monkeypatch.setattr(
        qlinear,
        "WORKING",
        {"one_row": False, "tensor_core": False, "general": True, "tensor_core_16": False, "fused": False},
    )
    monkeypatch.setattr(qlinear, "supports_general", lambda x, w, s, b, group_size, bits: bits in (4, 8))
    return calls


@pytest.mark.parametrize(
    "shape,route",
    [((1, 1, 128), "general"), ((2, 4, 128), "general"), ((3, 5, 128), "stock"), ((1, 400, 128), "dequant")],
)
@pytest.mark.parametrize("bias", [False, True])
def test_each_route_computes_the_same_product(forced, shape, route, bias) -> None:
    model = _model(bias=bias)
    layer = model.layers[0]
    x = mx.random.normal(shape)
    ref = layer(x)
    qlinear.route_quantized_linears(model, DEFAULTS)
    assert qlinear.route_for(shape[0] * shape[1], layer, x) == route
    got = layer(x)
    assert got.shape == ref.shape == (*shape[:-1], 64)
    assert mx.allclose(got, ref, atol=1e-4, rtol=1e-4).item(), float(mx.abs(got - ref).max())
    assert forced == ([("general", shape)] if route == "general" else [])  # x as it is: no reshape to encode


def test_a_kernel_not_probed_good_is_never_routed(forced, monkeypatch) -> None:
    monkeypatch.setattr(
        qlinear,
        "WORKING",
        {"one_row": False, "tensor_core": False, "general": False, "tensor_core_16": False, "fused": False},
    )
    model = _model()
    qlinear.route_quantized_linears(model, DEFAULTS)
    x = mx.random.normal((1, 128))
    assert qlinear.route_for(1, model.layers[0], x) == "stock"
    monkeypatch.setattr(qlinear, "WORKING", {})  # unprobed: unused too
    assert qlinear.route_for(1, model.layers[0], x) == "stock"


@pytest.mark.parametrize("failure", ["raises", "wrong", None])
def test_probe_records_which_kernels_work(monkeypatch, failure) -> None:
    def kernel(name, x, w, scales, biases, group_size, bits, **fused):
        if failure == "raises":
            raise RuntimeError("nvrtc: no kernel image for this device")
        ref = qmv_one_row_reference(x, w, scales, biases, group_size=group_size, bits=bits, **fused)
        return ref * 2 if failure == "wrong" else ref

    monkeypatch.setattr(qlinear, "_kernel_call", kernel)
    monkeypatch.setattr(qlinear, "WORKING", {})
    state = mx.random.state[0]  # (the default fused parts: the fused form is probed too)
    assert qlinear.probe_kernels(DEFAULTS) == dict.fromkeys(
        ("one_row", "tensor_core", "general", "tensor_core_16", "fused"), failure is None
    )
    assert mx.array_equal(mx.random.state[0], state).item()  # the global seed is untouched


def test_nine_to_sixteen_rows_take_the_two_block_tensor_core_kernel(forced, monkeypatch) -> None:
    monkeypatch.setattr(qlinear, "supports_tensor_core", lambda x, w, s, b, group_size, bits: bits == 4)
    model = _model()
    layer = model.layers[0]
    x = mx.random.normal((1, 12, 128))
    ref = layer(x)
    qlinear.route_quantized_linears(model, DEFAULTS)
    assert qlinear.route_for(12, layer, x) == "stock"  # the two-block variant not probed good
    monkeypatch.setitem(qlinear.WORKING, "tensor_core_16", True)
    assert qlinear.route_for(12, layer, x) == "tensor_core"
    assert qlinear.route_for(16, layer, mx.zeros((16, 128))) == "tensor_core"
    assert qlinear.route_for(17, layer, mx.zeros((17, 128))) == "stock"
    got = layer(x)
    assert mx.allclose(got, ref, atol=1e-4, rtol=1e-4).item()
    assert forced == [("tensor_core", (1, 12, 128))]  # x as it is: no reshape to encode


def test_unsupported_bits_take_the_stock_kernel(forced) -> None:
    model = _model(bits=6)
    qlinear.route_quantized_linears(model, DEFAULTS)
    x = mx.random.normal((1, 128))
    assert qlinear.route_for(1, model.layers[0], x) == "stock"
    model(x)
    assert forced == []


def test_huge_dense_copy_stays_stock(forced, monkeypatch) -> None:
    monkeypatch.setattr(qlinear, "DEQUANT_MAX_BYTES", 64 * 128 * 4 - 1)
    model = _model()
    qlinear.route_quantized_linears(model, DEFAULTS)
    assert qlinear.route_for(500, model.layers[0], mx.zeros((500, 128))) == "stock"


def test_routed_linears_off_turns_routes_off(monkeypatch) -> None:
    monkeypatch.setattr(qlinear, "backend", lambda: "cuda")
    assert qlinear.routes_enabled(DEFAULTS)
    assert not qlinear.routes_enabled(KernelOptions(routed_linears=False))


@pytest.mark.gpu
@pytest.mark.skipif(qlinear.backend() != "cuda", reason="needs the CUDA backend")
@pytest.mark.parametrize(
    "rows,route",
    [
        (1, "one_row"),
        (4, "tensor_core"),
        (8, "tensor_core"),
        (12, "tensor_core"),
        (16, "tensor_core"),
        (400, "dequant"),
    ],
)
@pytest.mark.parametrize("bits", [4, 8])
def test_gpu_routes_match_the_stock_layer(rows: int, route: str, bits: int) -> None:
    """On CUDA, every route (one-row / tensor-core / general kernels, dequantize + mat-mul) against
    MLX's stock quantized mat-mul, in bf16 as the models run."""
    mx.random.seed(1)
    layer = nn.QuantizedLinear(1024, 768, bias=True, group_size=64, bits=bits)
    layer.set_dtype(mx.bfloat16)  # bf16 scales and biases, as the models' layers have
    x = mx.random.normal((1, rows, 1024)).astype(mx.bfloat16)
    ref = layer(x).astype(mx.float32)
    qlinear.route_quantized_linears(nn.Sequential(layer), DEFAULTS)
    assert qlinear.route_for(rows, layer, x) == (
        route if bits == 4 or route in ("one_row", "dequant") else "general" if rows <= 8 else "stock"
    )
    got = layer(x).astype(mx.float32)
    err = float(mx.abs(got - ref).max() / mx.abs(ref).max())
    assert err < 1e-2, err


def test_families_without_qmv_keep_the_stock_mat_vec(forced) -> None:
    model = _model()
    qlinear.route_quantized_linears(model, DEFAULTS)
    x = mx.random.normal((1, 128))
    assert qlinear.route_for(1, model.layers[0], x) == "general"
    qlinear.route_quantized_linears(model, KernelOptions(families=frozenset({"gdn", "moe"})))
    assert qlinear.route_for(1, model.layers[0], x) == "stock"
    assert qlinear.route_for(400, model.layers[0], mx.zeros((400, 128))) == "dequant"  # not a kernel


@pytest.fixture
def fused_route(monkeypatch, on_cpu) -> list:
    """Routes on with the one-row and fused kernels probed good, run by their reference; records
    each kernel call's name, rows and which parts were fused (the parts: the options given to
    route_quantized_linears)."""
    calls = []

    def kernel(name, x, w, scales, biases, group_size, bits, **fused):
        rows = math.prod(x.shape[:-1])
        calls.append((name, rows, tuple(sorted(k for k, v in fused.items() if v is not None))))
        return qmv_one_row_reference(x, w, scales, biases, group_size=group_size, bits=bits, **fused)

    monkeypatch.setattr(qlinear, "routes_enabled", lambda options: True)
    monkeypatch.setattr(qlinear, "_kernel_call", kernel)
    monkeypatch.setattr(
        qlinear,
        "WORKING",
        {"one_row": True, "tensor_core": False, "general": False, "tensor_core_16": False, "fused": True},
    )
    monkeypatch.setattr(qlinear, "supports_one_row", lambda *a, **k: True)
    return calls


def test_norm_and_residual_fuse_into_one_row_calls_only(fused_route) -> None:
    model = _model()
    qlinear.route_quantized_linears(model, EVERY_PART)
    linear = model.layers[0]
    norm = nn.RMSNorm(128, eps=1e-5)
    norm.weight = 1 + 0.3 * mx.random.normal((128,))
    x, res = mx.random.normal((1, 1, 128)) * 3, mx.random.normal((1, 1, 64))
    assert mx.allclose(qlinear.normed_linear(norm, linear, x), linear(norm(x)), atol=1e-4).item()
    assert mx.allclose(qlinear.linear_plus(linear, x, res), res + linear(x), atol=1e-4).item()
    fused = [c for c in fused_route if c[0] == "fused"]
    assert fused == [("fused", 1, ("norm",)), ("fused", 1, ("residual",))]
    fused_route.clear()
    x2 = mx.random.normal((1, 2, 128))  # two rows: no fused kernel
    qlinear.normed_linear(norm, linear, x2)
    qlinear.linear_plus(linear, x2, mx.zeros((1, 2, 64)))
    assert all(c[0] != "fused" for c in fused_route)


@pytest.mark.parametrize("glu", [True, False])
@pytest.mark.parametrize("arch", ["qwen3_5_dense", "qwen3_5_moe", "nemotron_dense", "nemotron_moe"])
def test_a_decode_step_with_fused_norms_and_adds_matches_op_by_op(
    fused_route, monkeypatch, arch, glu
) -> None:
    """Decode with every fusable input norm and residual add inside the one-row mat-vecs (the
    kernel's reference standing in for it) gives the op-by-op logits; Qwen's SwiGLU made by the
    gate/up projection's epilogue ("glu") or, without that part, by the down projection ("act")."""
    from kapitsa.engine.loading.fuse import fuse_model
    from kapitsa.engine.models import base
    from tests.models.builders import build_ours, greedy_logits

    parts = frozenset(FUSED_PARTS) if glu else frozenset(FUSED_PARTS) - {"glu"}
    model = build_ours(arch)
    fuse_model(model)
    for layer in model.layers:
        nn.quantize(layer, group_size=32, bits=8, class_predicate=lambda _, m: isinstance(m, nn.Linear))
    qlinear.route_quantized_linears(model, KernelOptions(fused_parts=parts))

    def steps(compile_on: bool) -> list[mx.array]:
        base.use_kernel_options(model, KernelOptions(fused_parts=parts, compile_decode=compile_on))
        return greedy_logits(model)

    plain = steps(False)
    fused_route.clear()
    fast = steps(True)
    kinds = {c[2] for c in fused_route if c[0] == "fused"}
    assert {("norm",), ("residual",)} <= kinds  # both fusions ran in the compiled decode
    if arch == "qwen3_5_dense":  # and the MLP's SwiGLU, in the gate/up or the down projection
        assert (("glu", "norm") in kinds) == glu and (("act", "residual") in kinds) == (not glu)
    if arch == "qwen3_5_moe" and glu:  # the shared expert's SwiGLU (its input is normed already)
        assert ("glu",) in kinds
    if arch == "nemotron_dense":  # relu^2, made by the down projection
        assert ("act", "residual") in kinds
    for a, b in zip(plain, fast, strict=True):
        assert mx.allclose(a, b, atol=2e-4, rtol=2e-4).item(), float(mx.abs(a - b).max())


@pytest.mark.parametrize("parts", [("norm",), ("residual",), ("norm", "residual"), ("act",)])
def test_each_fused_part_switches_alone(fused_route, monkeypatch, parts) -> None:
    """With only some parts on, only those fuse; the rest run as written, with the same result."""
    model = _model()
    qlinear.route_quantized_linears(model, KernelOptions(fused_parts=frozenset(parts)))
    linear, down = model.layers
    norm = nn.RMSNorm(128)
    x, res = mx.random.normal((1, 1, 128)), mx.random.normal((1, 1, 64))
    assert mx.allclose(qlinear.normed_linear(norm, linear, x), linear(norm(x)), atol=1e-4).item()
    assert mx.allclose(qlinear.linear_plus(linear, x, res), res + linear(x), atol=1e-4).item()
    up, h = mx.random.normal((1, 1, 64)), mx.random.normal((1, 1, 32))
    relu2 = lambda v: mx.square(mx.maximum(v, 0))  # noqa: E731
    got = qlinear.act_linear_plus(down, up, h, "relu2", relu2)
    assert mx.allclose(got, h + down(relu2(up)), atol=1e-4).item()
    fused = [c for c in fused_route if c[0] == "fused"]
    expected = [("fused", 1, ("norm",))] if "norm" in parts else []
    expected += [("fused", 1, ("residual",))] if "residual" in parts else []
    expected += [("fused", 1, ("residual",))] if "residual" in parts and "act" not in parts else []
    expected += [("fused", 1, ("act", "residual"))] if "act" in parts else []
    assert fused == expected


def test_the_opt_in_fused_kernel_is_not_probed_when_off(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(qlinear, "_kernel_call", lambda name, *a, **k: calls.append(name) or a[0][:, :64])
    monkeypatch.setattr(qlinear, "WORKING", {})
    assert (
        "fused" not in qlinear.probe_kernels(KernelOptions(fused_parts=frozenset())) and "fused" not in calls
    )


def test_fused_norms_switch_off(fused_route) -> None:
    model = _model()
    qlinear.route_quantized_linears(model, KernelOptions(fused_parts=frozenset()))
    norm = nn.RMSNorm(128)
    qlinear.normed_linear(norm, model.layers[0], mx.random.normal((1, 128)))
    assert fused_route == [("one_row", 1, ())]


@pytest.mark.parametrize("parts", [("glu",), ("glu", "norm"), ("norm", "residual")])
def test_glu_linear_fuses_only_with_its_part(fused_route, monkeypatch, parts) -> None:
    """silu(gate) * up of a [gate | up] projection: in the one-row kernel's epilogue with part
    "glu" (the norm in its prologue with part "norm" too), else None for the caller's ops."""
    model = _model()
    qlinear.route_quantized_linears(model, KernelOptions(fused_parts=frozenset(parts)))
    linear = model.layers[0]  # 128 -> 64: gate and up of 32 columns each
    norm = nn.RMSNorm(128)
    norm.weight = 1 + 0.3 * mx.random.normal((128,))
    x = mx.random.normal((1, 1, 128)) * 3
    want = nn.silu(linear(norm(x))[..., :32]) * linear(norm(x))[..., 32:]
    fused_route.clear()
    got = qlinear.glu_linear(linear, x, norm)
    if "glu" not in parts:
        assert got is None and fused_route == []
        return
    assert got.shape == (1, 1, 32) and mx.allclose(got, want, atol=1e-4).item()
    assert [c for c in fused_route if c[0] == "fused"] == [
        ("fused", 1, ("glu", "norm") if "norm" in parts else ("glu",))
    ]
    assert qlinear.glu_linear(linear, mx.random.normal((1, 2, 128)), norm) is None  # two rows: the ops


def test_exact_verify_takes_the_one_row_routes_up_to_eight_rows(fused_route) -> None:
    """With exact_verify a verify's rows (2-8) take the decode step's one-row kernel, its fused norm
    and residual included; past eight rows, and without the option, they do not."""
    model = _model()
    qlinear.route_quantized_linears(model, KernelOptions(exact_verify=True))
    linear = model.layers[0]
    norm = nn.RMSNorm(128, eps=1e-5)
    for rows, fused in ((4, True), (8, True), (9, False)):
        fused_route.clear()
        x = mx.random.normal((1, rows, 128))
        got = qlinear.normed_linear(norm, linear, x)
        assert mx.allclose(got, linear(norm(x)), atol=1e-4).item()
        qlinear.linear_plus(linear, x, mx.zeros((1, rows, 64)))
        assert (("fused", rows, ("norm",)) in fused_route) is fused
        assert (("fused", rows, ("residual",)) in fused_route) is fused
    assert qlinear.route_for(5, linear, mx.zeros((5, 128))) == "one_row"
    qlinear.route_quantized_linears(model, DEFAULTS)
    assert qlinear.route_for(5, linear, mx.zeros((5, 128))) != "one_row"


def test_rows_apart_gives_each_token_a_call_of_its_own(monkeypatch, on_cpu) -> None:
    """On CUDA a verify's 2-16 tokens reach the product as one call per token, `[..., 1, K]` (MLX
    folds leading axes into a GEMM's rows, so a batch axis would not do); one token, and 17+, go
    as they are."""
    seen = []
    w = mx.random.normal((32, 128))

    def product(x):
        seen.append(x.shape)
        return x @ w.T

    monkeypatch.setattr(qlinear, "backend", lambda: "cuda")
    for shape, calls in (
        ((2, 5, 128), [(2, 1, 128)] * 5),
        ((1, 1, 128), [(1, 1, 128)]),
        ((1, 17, 128), [(1, 17, 128)]),
    ):
        seen.clear()
        x = mx.random.normal(shape)
        got = qlinear.rows_apart(product, x)
        assert seen == calls and got.shape == (*shape[:-1], 32)
        assert mx.allclose(got, x @ w.T, atol=1e-5).item()
    monkeypatch.setattr(qlinear, "backend", lambda: None)
    seen.clear()
    qlinear.rows_apart(product, mx.zeros((1, 5, 128)))
    assert seen == [(1, 5, 128)]  # off CUDA: as it is


def test_exact_verify_of_a_batch_calls_each_token_as_its_decode_step(fused_route, monkeypatch) -> None:
    """Several sequences' verify (B > 1): each token's B rows as one call, the batch's decode step;
    one sequence: one fused call of its T rows."""
    monkeypatch.setattr(qlinear, "backend", lambda: "cuda")
    model = _model()
    qlinear.route_quantized_linears(model, KernelOptions(exact_verify=True))
    linear, norm = model.layers[0], nn.RMSNorm(128, eps=1e-5)
    x = mx.random.normal((3, 4, 128))
    got = qlinear.normed_linear(norm, linear, x)
    assert mx.allclose(got, linear(norm(x)), atol=1e-4).item()
    assert [c for c in fused_route if c[0] != "fused"][:4] == [("one_row", 3, ())] * 4
    assert all(c[0] != "fused" for c in fused_route)
    fused_route.clear()
    qlinear.normed_linear(norm, linear, x[:1])
    assert fused_route == [("fused", 4, ("norm",))]
