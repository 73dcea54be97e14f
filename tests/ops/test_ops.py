"""Each op's fast path against its plain MLX-ops reference."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from kapitsa.engine.models.base import use_kernel_options
from kapitsa.engine.ops.conv import causal_conv, causal_conv_reference, conv_state_after
from kapitsa.engine.ops.gated_delta import gated_delta, gated_delta_reference, gdn_decay, l2norm_qk
from kapitsa.engine.ops.moe import SwitchGLU, SwitchReluSquared, experts_reference
from kapitsa.engine.ops.rope import Rope, rope_reference
from kapitsa.engine.ops.ssm import ssm_dt, ssm_scan, ssm_scan_reference
from kapitsa.engine.options import KernelOptions


def _close(a, b, tol=1e-5):
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item() < tol


def _gdn_inputs(B=2, T=9, Hk=2, Hv=4, Dk=32, Dv=16, seed=0):
    mx.random.seed(seed)
    q, k = l2norm_qk(mx.random.normal((B, T, Hk, Dk)), mx.random.normal((B, T, Hk, Dk)))
    v = mx.random.normal((B, T, Hv, Dv))
    g = gdn_decay(mx.log(mx.random.uniform(1, 16, (Hv,))), mx.random.normal((B, T, Hv)), mx.ones((Hv,)))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, g, beta, state


def test_gated_delta_fast_equals_reference():
    q, k, v, g, beta, s = _gdn_inputs()
    y1, s1 = gated_delta(q, k, v, g, beta, s)
    y2, s2 = gated_delta_reference(q, k, v, g, beta, s)
    assert s1.dtype == mx.float32 and _close(y1, y2) and _close(s1, s2)


def test_gated_delta_mask_freezes_state_and_prefix_equals_short_run():
    q, k, v, g, beta, s = _gdn_inputs()
    mask = mx.arange(9)[None] < mx.array([[4], [9]])
    for fn in (gated_delta, gated_delta_reference):
        y, state = fn(q, k, v, g, beta, s, mask)
        _, short = fn(q[:1, :4], k[:1, :4], v[:1, :4], g[:1, :4], beta[:1, :4], s[:1])
        assert _close(state[:1], short) and _close(y[0, 4:], mx.zeros_like(y[0, 4:]))


def test_gated_delta_chunks_compose():
    q, k, v, g, beta, s = _gdn_inputs(T=8)
    _, whole = gated_delta(q, k, v, g, beta, s)
    _, half = gated_delta(q[:, :5], k[:, :5], v[:, :5], g[:, :5], beta[:, :5], s)
    _, rest = gated_delta(q[:, 5:], k[:, 5:], v[:, 5:], g[:, 5:], beta[:, 5:], half)
    assert _close(whole, rest)


def _ssm_inputs(B=2, T=150, H=6, P=4, G=2, N=8, seed=1):
    mx.random.seed(seed)
    x = mx.random.normal((B, T, H, P))
    dt = ssm_dt(mx.random.normal((B, T, H)), mx.random.uniform(-2, 0, (H,)), (0.0, float("inf")))
    return (
        x,
        dt,
        mx.log(mx.random.uniform(1, 8, (H,))),
        mx.random.normal((B, T, G, N)),
        mx.random.normal((B, T, G, N)),
        mx.random.uniform(0.5, 1.5, (H,)),
        mx.random.normal((B, H, P, N)) * 0.1,
    )


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 64), (64, 64), (150, 64), (150, 32), (300, 256)])
def test_ssm_chunked_scan_equals_reference(T, chunk):
    x, dt, A_log, Bm, Cm, D, s = _ssm_inputs(T=T)
    y1, s1 = ssm_scan(x, dt, A_log, Bm, Cm, D, s, chunk=chunk)
    y2, s2 = ssm_scan_reference(x, dt, A_log, Bm, Cm, D, s)
    # relative to the largest value: longer chunks difference longer cumulative decay sums
    assert _close(y1, y2, 1e-5 * mx.abs(y2).max().item()) and _close(s1, s2, 1e-5 * mx.abs(s2).max().item())


def test_ssm_zero_dt_is_identity_and_limits_clip():
    x, dt, A_log, Bm, Cm, D, s = _ssm_inputs(T=7)
    mask = mx.arange(7)[None] < mx.array([[3], [7]])
    masked = dt * mask[..., None]
    _, state = ssm_scan(x, masked, A_log, Bm, Cm, D, s)
    _, short = ssm_scan_reference(x[:1, :3], dt[:1, :3], A_log, Bm[:1, :3], Cm[:1, :3], D, s[:1])
    assert _close(state[:1], short, 1e-5)
    clipped = ssm_dt(mx.full((1, 1, 2), 10.0), mx.zeros((2,)), (0.5, 2.0))
    assert mx.all(clipped == 2.0).item()
    padded = ssm_dt(mx.ones((1, 2, 2)), mx.zeros((2,)), (0.0, float("inf")), mx.array([[True, False]]))
    assert padded[0, 1].sum().item() == 0.0


@pytest.mark.parametrize("T", [1, 6, 40])
def test_causal_conv_paths_equal_reference(T):
    mx.random.seed(2)
    conv_in = mx.random.normal((2, 3 + T, 12))
    w, b = mx.random.normal((12, 4, 1)), mx.random.normal((12,))
    assert _close(causal_conv(conv_in, w, b), causal_conv_reference(conv_in, w, b))
    assert _close(
        causal_conv(conv_in, w), nn.Conv1d(12, 12, 4, groups=12, bias=False).update({"weight": w})(conv_in)
    )


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_causal_conv_rows_do_not_depend_on_the_row_count(dtype):
    """Each decode step's conv row equals the verify's (and a prefill's) row at that position, bit
    for bit: greedy speculation writes plain decoding's tokens only if they do."""
    mx.random.seed(3)
    conv_in = (mx.random.normal((2, 3 + 40, 64)) * 2).astype(dtype)
    w = mx.random.normal((64, 4, 1)).astype(dtype)
    for T in (8, 40):  # a verify's short form and a prefill's long one
        many = causal_conv(conv_in[:, : 3 + T], w)
        for t in range(T):
            assert mx.array_equal(causal_conv(conv_in[:, t : t + 4], w)[:, 0], many[:, t]).item(), (T, t)


def test_conv_state_after_takes_each_rows_window():
    conv_in = mx.arange(2 * 9).reshape(2, 9, 1)  # K-1 = 3 old rows + 6 new
    out = conv_state_after(conv_in, [2, 6], 4)
    assert out[0, :, 0].tolist() == [2, 3, 4] and out[1, :, 0].tolist() == [15, 16, 17]
    assert conv_state_after(conv_in, None, 4)[0, :, 0].tolist() == [6, 7, 8]


def test_rope_fast_equals_reference_with_ragged_offsets():
    mx.random.seed(3)
    x = mx.random.normal((2, 3, 5, 16))
    rope = Rope(8, 10000.0)
    assert _close(rope(x, 7), rope_reference(x, 8, rope.inv_freq, 7), 1e-4)
    offsets = mx.array([0, 13], dtype=mx.int32)
    assert _close(rope(x, offsets), rope_reference(x, 8, rope.inv_freq, offsets), 1e-4)
    assert _close(rope(x, offsets)[..., 8:], x[..., 8:])  # partial rotation leaves the rest alone
    scaled = Rope(8, 10000.0, {"rope_type": "linear", "factor": 2.0})
    assert _close(scaled(x, 3), rope_reference(x, 8, scaled.inv_freq, 3), 1e-4)


@pytest.mark.parametrize("tokens", [3, 40])  # below / above the sort threshold
def test_switch_glu_equals_per_expert_reference(tokens):
    mx.random.seed(4)
    glu = SwitchGLU(16, 24, 6)
    x = mx.random.normal((2, tokens, 16))
    inds = mx.random.randint(0, 6, (2, tokens, 2))

    def expert(e, h):
        gate, up, down = (getattr(glu, n).weight[e] for n in ("gate_proj", "up_proj", "down_proj"))
        return (nn.silu(h @ gate.T) * (h @ up.T)) @ down.T

    assert _close(glu(x, inds), experts_reference(x, inds, expert), 1e-4)


def test_relu_squared_experts_and_quantized_path():
    mx.random.seed(5)
    mlp = SwitchReluSquared(64, 32, 4)
    x = mx.random.normal((1, 70, 64))
    inds = mx.random.randint(0, 4, (1, 70, 2))

    def expert(e, h):
        return mx.square(nn.relu(h @ mlp.fc1.weight[e].T)) @ mlp.fc2.weight[e].T

    want = experts_reference(x, inds, expert)
    assert _close(mlp(x, inds), want, 1e-4)
    nn.quantize(mlp, group_size=32, bits=8)
    assert "scales" in mlp.fc1 and _close(mlp(x, inds), want, 0.05 * mx.abs(want).max().item())


@pytest.mark.parametrize(
    ("mode", "group_size", "bits"), [("affine", 64, 4), ("affine", 32, 8), ("mxfp4", 32, 4), ("nvfp4", 16, 4)]
)
def test_quantized_switch_linear_equals_its_dequantized_weights(mode, group_size, bits):
    from kapitsa.engine.ops.moe import SwitchLinear

    mx.random.seed(6)
    layer = SwitchLinear(64, 48, 4)
    q = layer.to_quantized(group_size, bits, mode)
    dense = mx.dequantize(q.weight, q.scales, q.get("biases"), group_size, bits, mode=mode)
    x = mx.random.normal((5, 1, 1, 64))
    inds = mx.array([[0], [3], [1], [1], [2]])  # [tokens, k=1]
    want = mx.stack([x[i, 0, 0] @ dense[int(inds[i, 0])].T for i in range(5)])
    assert _close(q(x, inds)[:, 0, 0], want, 1e-3)


def test_tree_helpers_reduce_to_chains():
    from kapitsa.engine.ops.tree import conv_windows, tree_attention_mask, tree_conv, tree_positions

    chain = [[-1, 0, 1, 2, 3]]
    mx.random.seed(7)
    conv_in = mx.random.normal((1, 3 + 5, 6))
    w = mx.random.normal((6, 4, 1))
    assert _close(tree_conv(conv_in, conv_windows(chain, 4), w), causal_conv_reference(conv_in, w))
    assert tree_positions(chain, [10]).tolist() == [[10, 11, 12, 13, 14]]
    rope = Rope(8, 10000.0)
    x = mx.random.normal((1, 2, 5, 16))
    assert _close(rope.at_positions(x, tree_positions(chain, [10])), rope(x, 10), 1e-4)
    branchy = [[-1, 0, 0, 2]]  # node 2 and its child 3 skip node 1
    assert conv_windows(branchy, 3)[0].tolist() == [[0, 1, 2], [1, 2, 3], [1, 2, 4], [2, 4, 5]]
    mask = tree_attention_mask(branchy, [2], 6)[0, 0]
    assert mask[3].tolist() == [True, True, True, False, True, True]  # prefix, root, node 2, itself


@pytest.fixture
def moe_dequant_on_cuda(monkeypatch):
    """The MoE prefill route as on CUDA (backend reported as cuda), counting its calls."""
    import kapitsa.engine.kernels as kernels
    from kapitsa.engine.ops import moe

    calls = []
    real = moe._dequant_gather
    monkeypatch.setattr(kernels, "backend", lambda: "cuda")
    monkeypatch.setattr(moe, "_dequant_gather", lambda *a: calls.append(a[1].shape) or real(*a))
    return calls


@pytest.mark.parametrize(("kind", "mode"), [("glu", "affine"), ("relu2", "affine"), ("relu2", "mxfp4")])
def test_many_sorted_rows_take_the_dequantized_grouped_gemm_with_the_same_result(
    moe_dequant_on_cuda, kind, mode
):

    mx.random.seed(8)
    experts = SwitchGLU(64, 32, 8) if kind == "glu" else SwitchReluSquared(64, 32, 8)
    nn.quantize(experts, group_size=32, bits=4, mode=mode)
    experts.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 160, 64)).astype(mx.bfloat16)
    indices = mx.random.randint(0, 8, (1, 160, 4))  # 640 token-expert rows
    routed = experts(x, indices)
    assert moe_dequant_on_cuda, "the dequantize + gather_mm route was not taken"
    use_kernel_options(experts, KernelOptions(moe_dequant=False))
    plain = experts(x, indices)
    experts.set_dtype(mx.float32)  # float32 scales: the same weights, a float32 reference
    exact = experts(x.astype(mx.float32), indices)

    def err(y):
        return mx.abs(y.astype(mx.float32) - exact).max().item()

    # bf16 roundings differ (the dense copy rounds each weight once): no worse than gather_qmm's
    assert err(routed) <= 2 * err(plain) + 1e-3, (err(routed), err(plain))


def test_few_rows_or_a_big_stack_keep_gather_qmm(moe_dequant_on_cuda, monkeypatch):
    from kapitsa.engine.ops import moe

    mx.random.seed(9)
    experts = SwitchReluSquared(64, 32, 8)
    nn.quantize(experts, group_size=32, bits=4)
    experts.set_dtype(mx.bfloat16)
    few = mx.random.normal((1, 20, 64)).astype(mx.bfloat16)
    experts(few, mx.random.randint(0, 8, (1, 20, 4)))  # 80 rows: sorted, but under min_rows
    monkeypatch.setattr(moe, "MOE_DEQUANT_MAX_BYTES", 8 * 32 * 64 * 2 - 1)  # fc1's dense copy is over
    many = mx.random.normal((1, 160, 64)).astype(mx.bfloat16)
    experts(many, mx.random.randint(0, 8, (1, 160, 4)))
    assert moe_dequant_on_cuda == []


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["glu", "relu2"])
def test_gpu_moe_prefill_route_matches_gather_qmm(kind):
    """On CUDA: a prefill-sized expert call through the dequantized grouped GEMM against MLX's
    gather_qmm, bf16, at Nemotron's hidden width."""
    from kapitsa.engine.kernels import backend

    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    mx.random.seed(10)
    experts = SwitchGLU(2688, 512, 16) if kind == "glu" else SwitchReluSquared(2688, 512, 16)
    nn.quantize(experts, group_size=64, bits=4)
    experts.set_dtype(mx.bfloat16)
    x = mx.random.normal((1, 1024, 2688)).astype(mx.bfloat16)
    indices = mx.random.randint(0, 16, (1, 1024, 6))
    routed = experts(x, indices)
    use_kernel_options(experts, KernelOptions(moe_dequant=False))
    plain = experts(x, indices)
    err = mx.abs(routed.astype(mx.float32) - plain.astype(mx.float32)).max().item()
    assert err <= 2e-2 * mx.abs(plain.astype(mx.float32)).max().item(), err
