"""The fused Gated DeltaNet step against its reference and the model's current layer.

CPU (CI): the reference reproduces `GatedDeltaNet.__call__` (both Qwen3.5 and Qwen3-Next layouts,
ragged batches), a NumPy transcription of the kernel's algorithm (channel mapping, chunking, lane
column layout, mask, norm) matches the reference, launch configurations stay in their limits,
dispatch falls back, and every CUDA variant compiles with nvcc. The kernels themselves run under
the `gpu` (CUDA) and `metal` markers.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import tempfile

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from nvcc_check import STUB, assert_compiles, compile_source, nvcc

from kapitsa.engine.cache.layers import RecurrentCache, StepInfo
from kapitsa.engine.kernels import backend, gdn
from kapitsa.engine.kernels.cuda import cuda_type
from kapitsa.engine.kernels.metal import read_source
from kapitsa.engine.models.qwen3_5 import GatedDeltaNet, ModelArgs
from kapitsa.engine.ops.conv import causal_conv_reference

SHAPES = {"27b": (16, 48, 128, 128), "4b": (16, 32, 128, 128)}  # Hk, Hv, Dk, Dv


def make_inputs(B, T, hk, hv, dk, dv, *, dtype=mx.float32, K=4, seed=0, mask=None, state=True):
    """Random inputs with realistic magnitudes: decays in (0, 1), unit-norm-ish q/k, O(1) values."""
    mx.random.seed(seed)
    C = 2 * hk * dk + hv * dv
    args = dict(
        conv_in=mx.random.normal((B, K - 1 + T, C)).astype(dtype),
        conv_weight=(0.5 * mx.random.normal((C, K, 1))).astype(dtype),
        a=mx.random.normal((B, T, hv)).astype(dtype),
        b=mx.random.normal((B, T, hv)).astype(dtype),
        A_log=mx.log(mx.random.uniform(1.0, 16.0, (hv,))),
        dt_bias=mx.random.normal((hv,)).astype(dtype),
        z=mx.random.normal((B, T, hv, dv)).astype(dtype),
        norm_weight=(1.0 + 0.1 * mx.random.normal((dv,))).astype(dtype),
        state=0.1 * mx.random.normal((B, hv, dv, dk)) if state else None,
    )
    heads = dict(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, norm_eps=1e-6, mask=mask)
    return args, heads


def assert_close(got: mx.array, ref: mx.array, dtype, *, fp32_tol: float = 1e-4) -> None:
    """float32: max error within fp32_tol of the largest value. bf16/fp16: the op path rounds
    q/k/v/y/norm in the activation dtype and the kernel accumulates the conv and dots in float32,
    so single values may differ by a few ulps (about 1-2% of the largest output, as much as
    either differs from a float32 evaluation) while the mean error stays small."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, (got.shape, ref.shape, got.dtype, ref.dtype)
    worst = rel_err(got, ref)
    if dtype == mx.float32:
        assert worst < fp32_tol, worst
        return
    diff = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))
    mean = float(diff.mean()) / max(float(mx.abs(ref.astype(mx.float32)).mean()), 1e-6)
    assert worst < 4e-2 and mean < 1e-2, (worst, mean)


def rel_err(got: mx.array, ref: mx.array) -> float:
    got, ref = got.astype(mx.float32), ref.astype(mx.float32)
    return float(mx.abs(got - ref).max()) / max(float(mx.abs(ref).max()), 1e-6)


# ---------------------------------------------------------------- reference == the model's layer


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("lengths", [[1, 1], [3, 3], [3, 1]])
@pytest.mark.parametrize("fused", [False, True])
def test_reference_matches_model_layer(model_type: str, lengths: list[int], fused: bool) -> None:
    """`gdn_step_reference` on the layer's own conv_in/z/a/b gives its output and next state;
    with the layer's fused in-projection, z/b/a given as `projection_views` of it do too."""
    mx.random.seed(3)
    args = ModelArgs(
        model_type=model_type,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
    )
    layer = GatedDeltaNet(args)
    layer.conv1d.weight = 0.5 * mx.random.normal(layer.conv1d.weight.shape)
    layer.A_log = mx.log(mx.random.uniform(1.0, 16.0, (4,)))
    layer.dt_bias = mx.random.normal((4,))
    layer.norm.weight = 1.0 + 0.1 * mx.random.normal((32,))
    layer.out_proj = nn.Identity()  # the layer then returns the gated norm's output
    if fused:
        assert layer.fuse()
    B, T = len(lengths), max(lengths)
    conv = mx.random.normal((B, 3, layer.conv_dim))
    state = 0.1 * mx.random.normal((B, 4, 32, 32))
    cache = RecurrentCache((3, layer.conv_dim), (4, 32, 32), conv=conv, state=state)
    x = mx.random.normal((B, T, 64))
    info = StepInfo(T, lengths, [5] * B)
    got_layer = layer(x, info, cache)

    qkv, z, b, a = layer._project(x)
    if fused:
        dims = dict(num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=32)
        z, b, a = gdn.projection_views(layer.in_proj(x), packed=layer.packed, **dims)
    out, new_state = gdn.gdn_step_reference(
        mx.concatenate([conv, qkv], axis=1),
        layer.conv1d.weight,
        a,
        b,
        layer.A_log,
        layer.dt_bias,
        z,
        layer.norm.weight,
        state,
        num_k_heads=2,
        num_v_heads=4,
        head_k_dim=32,
        head_v_dim=32,
        norm_eps=args.rms_norm_eps,
        mask=info.recurrent_mask,
    )
    assert mx.allclose(out, got_layer, rtol=1e-5, atol=1e-6).item()
    assert mx.allclose(new_state, cache.state, rtol=1e-5, atol=1e-6).item()


def test_masked_steps_keep_state_and_output_zero() -> None:
    args, heads = make_inputs(2, 3, 1, 2, 32, 32, mask=mx.array([[True, False, True], [False, False, False]]))
    out, state = gdn.gdn_step_reference(**args, **heads)
    assert mx.array_equal(out[0, 1], mx.zeros_like(out[0, 1])).item()
    assert mx.array_equal(out[1], mx.zeros_like(out[1])).item()
    assert mx.array_equal(state[1], args["state"][1]).item()  # a fully masked row keeps its state
    # Row 0 equals running its real tokens 0 and 2 alone, one at a time (each with its conv window).
    row0 = dict(args, state=args["state"][:1])
    first, s1 = gdn.gdn_step_reference(**_one_token(row0, args, 0), **dict(heads, mask=None))
    second, s2 = gdn.gdn_step_reference(**_one_token(dict(row0, state=s1), args, 2), **dict(heads, mask=None))
    assert mx.allclose(out[0, 0], first[0, 0], atol=1e-6).item()
    assert mx.allclose(out[0, 2], second[0, 0], atol=1e-6).item()
    assert mx.allclose(state[0], s2[0], atol=1e-6).item()


def _one_token(base: dict, full: dict, t: int) -> dict:
    """Row 0's token t as a T=1 call (its conv window is rows t..t+K-1 of conv_in)."""
    K = full["conv_weight"].shape[1]
    return dict(
        base,
        conv_in=full["conv_in"][:1, t : t + K],
        a=full["a"][:1, t : t + 1],
        b=full["b"][:1, t : t + 1],
        z=full["z"][:1, t : t + 1],
    )


# --------------------------------------------- NumPy transcription of the kernel's algorithm


def _np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def kernel_transcription(args: dict, heads: dict, *, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The CUDA/Metal body step by step in float32 (fp32 inputs, so its roundings are identities):
    per block (row bi, head h) phases 1-4 per chunk of `chunk` tokens, the state held as lanes'
    column slots (gdn_col) to pin the layout."""
    views = {k: v for k, v in args.items() if isinstance(v, gdn.HeadView)}
    f = {
        k: None if v is None else np.array(views[k].array if k in views else v, np.float32)
        for k, v in args.items()
    }
    mask = heads["mask"]
    hk, hv, dk, dv = (heads[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    B, T = f["conv_in"].shape[0], f["conv_in"].shape[1] - f["conv_weight"].shape[1] + 1

    def head_values(name: str, bi: int, t: int, h: int, width: int) -> np.ndarray:
        """The kernel's z/a/b addressing: row * ROW + OFF + (h / GROUP) * GSTRIDE + (h % GROUP) * width."""
        row = f[name].reshape(B, T, -1)[bi, t]
        v = views.get(name, gdn.HeadView(None, 0, hv, 0))
        start = v.offset + (h // v.group) * v.group_stride + (h % v.group) * width
        return row[start : start + width]

    K = f["conv_weight"].shape[1]
    W = 2 * dk + dv
    cols = dk // 32
    vec = 4 if cols % 4 == 0 else 2 if cols % 2 == 0 else 1
    slot_cols = np.array([[gdn_col(vec, lane, j) for j in range(cols)] for lane in range(32)])
    out = np.zeros((B, T, hv, dv), np.float32)
    new_state = np.zeros((B, hv, dv, dk), np.float32)
    for bi in range(B):
        for h in range(hv):
            kh = h // (hv // hk)
            s = (f["state"][bi, h] if f["state"] is not None else np.zeros((dv, dk), np.float32))[
                :, slot_cols
            ]
            for t0 in range(0, T, chunk):
                tn = min(chunk, T - t0)
                qkv = np.zeros((tn, W), np.float32)
                for t in range(tn):
                    for j in range(W):
                        c = _channel(j, h, kh, hk, dk, dv)
                        x = sum(
                            f["conv_in"][bi, t0 + t + tap, c] * f["conv_weight"][c, tap, 0]
                            for tap in range(K)
                        )
                        qkv[t, j] = x * _np_sigmoid(x)
                for t in range(tn):
                    for part, scale in ((0, 1.0 / dk), (1, dk**-0.5)):
                        x = qkv[t, part * dk : (part + 1) * dk]
                        x *= scale / np.sqrt(np.mean(x * x) + 1e-6 / dk)
                for t in range(tn):
                    dt = head_values("a", bi, t0 + t, h, 1)[0] + f["dt_bias"][h]
                    g = np.exp(-np.exp(f["A_log"][h]) * np.logaddexp(dt, 0.0))
                    beta = _np_sigmoid(head_values("b", bi, t0 + t, h, 1)[0])
                    if mask is not None and not bool(np.array(mask)[bi, t0 + t]):
                        qkv[t, 2 * dk :] = 0.0
                        continue
                    q, k = qkv[t, :dk][slot_cols], qkv[t, dk : 2 * dk][slot_cols]
                    s *= g
                    kv = (s * k).sum(axis=(1, 2))
                    s += (beta * (qkv[t, 2 * dk :] - kv))[:, None, None] * k
                    qkv[t, 2 * dk :] = (s * q).sum(axis=(1, 2))
                for t in range(tn):
                    y = qkv[t, 2 * dk :]
                    z = head_values("z", bi, t0 + t, h, dv)
                    normed = y / np.sqrt(np.mean(y * y) + heads["norm_eps"]) * f["norm_weight"]
                    out[bi, t0 + t, h] = normed * z * _np_sigmoid(z)
            new_state[bi, h][:, slot_cols] = s
    return out.reshape(B, T, hv * dv), new_state


def embed_in_projection(args: dict, *, packed: bool, hk: int, hv: int, dk: int, dv: int) -> dict:
    """z, b, a written into a random fused in-projection `[B, T, N]`; returned as its views."""
    per = hv // hk
    n = hk * (2 * dk + 2 * per * dv + 2 * per) if packed else 2 * hk * dk + 2 * hv * dv + 2 * hv
    B, T = args["a"].shape[:2]
    proj = np.random.default_rng(0).normal(size=(B, T, n)).astype(np.float32)
    z, b, a = gdn.projection_views(
        mx.zeros((B, T, n)), packed=packed, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv
    )
    for view, name, width in ((z, "z", dv), (b, "b", 1), (a, "a", 1)):
        proj[..., np.array(view.columns(hv, width))] = np.array(args[name].astype(mx.float32)).reshape(
            B, T, -1
        )
    proj = mx.array(proj)
    views = gdn.projection_views(
        proj, packed=packed, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv
    )
    return dict(zip(("z", "b", "a"), views, strict=True))


def _channel(j: int, h: int, kh: int, hk: int, dk: int, dv: int) -> int:
    """Conv channel of the head's j-th q|k|v value (channels are all q heads, all k, all v)."""
    if j < dk:
        return kh * dk + j
    if j < 2 * dk:
        return hk * dk + kh * dk + j - dk
    return 2 * hk * dk + h * dv + j - 2 * dk


def gdn_col(vec: int, lane: int, j: int) -> int:
    """Python copy of the kernels' gdn_col."""
    return (j // vec) * 32 * vec + lane * vec + j % vec


@pytest.mark.parametrize("dk", [32, 64, 96, 128, 256])
def test_lane_columns_tile_each_row_once(dk: int) -> None:
    cols = dk // 32
    vec = 4 if cols % 4 == 0 else 2 if cols % 2 == 0 else 1
    got = sorted(gdn_col(vec, lane, j) for lane in range(32) for j in range(cols))
    assert got == list(range(dk))
    for lane in range(32):  # each vector load is VEC contiguous, VEC-aligned floats
        for c in range(cols // vec):
            first = gdn_col(vec, lane, c * vec)
            assert first % vec == 0 and [gdn_col(vec, lane, c * vec + e) for e in range(vec)] == list(
                range(first, first + vec)
            )


@pytest.mark.parametrize("chunk", [2, 5])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("layout", ["plain", "qwen3_5", "qwen3_next"])
def test_kernel_transcription_matches_reference(chunk: int, masked: bool, layout: str) -> None:
    mask = mx.array([[True, True, False, True, True], [True, False, False, True, False]]) if masked else None
    args, heads = make_inputs(2, 5, 2, 4, 64, 32, mask=mask, seed=7)
    ref_out, ref_state = gdn.gdn_step_reference(**args, **heads)
    if layout != "plain":  # z, b, a inside a fused projection full of other values
        args = dict(
            args, **embed_in_projection(args, packed=layout == "qwen3_next", hk=2, hv=4, dk=64, dv=32)
        )
    got_out, got_state = kernel_transcription(args, heads, chunk=chunk)
    np.testing.assert_allclose(got_out, np.array(ref_out), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_state, np.array(ref_state), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------- launch limits and dispatch


@pytest.mark.parametrize("kind", ["cuda", "metal"])
def test_launch_config_stays_within_limits(kind: str, monkeypatch) -> None:
    monkeypatch.setattr(gdn, "backend", lambda: kind)
    for dk in range(32, 257, 32):
        for dv in range(32, 257, 32):
            warps = gdn.warps_for(dk, dv, gdn.MAX_WARPS[kind])
            assert dv % warps == 0 and warps * 32 <= 1024
            template, grid, group = gdn.launch_config(
                kind, **_config_args(mx.bfloat16, T=gdn.MAX_T, dk=dk, dv=dv)
            )
            values = dict(template)
            shared = values["TC"] * (4 * (2 * dk + dv) + 12)
            assert shared <= gdn.SHARED_BUDGET[kind] and values["TC"] >= 1
            assert group == (warps * 32, 1, 1) and grid == (3 * 4 * warps * 32, 1, 1)
            rows, cols = dv // warps, dk // 32
            supported = gdn.supports(
                mx.zeros((1, 4, 2 * dk + dv)),
                mx.zeros((2 * dk + dv, 4, 1)),
                None,
                **dict(num_k_heads=1, num_v_heads=1, head_k_dim=dk, head_v_dim=dv),
            )
            assert supported == (rows * cols <= gdn.MAX_STATE_FLOATS) == (dk * dv <= 16384)
    # The real models' heads: 16 warps x 8 rows x 4 columns per thread, one chunk for T <= 16.
    template, _, _ = gdn.launch_config("cuda", **_config_args(mx.bfloat16, T=16, dk=128, dv=128))
    assert dict(template)["NW"] == 16 and dict(template)["TC"] == 16


def _config_args(dtype, *, T: int, dk: int, dv: int, has_mask: bool = True) -> dict:
    return dict(
        act=dtype,
        out_dtype=dtype,
        sum_dtype=dtype,
        beta_dtype=dtype,
        batch=3,
        T=T,
        K=4,
        num_k_heads=2,
        num_v_heads=4,
        head_k_dim=dk,
        head_v_dim=dv,
        norm_eps=1e-6,
        has_state=True,
        has_mask=has_mask,
    )


def test_float_bits_round_trips() -> None:
    for eps in (1e-6, 1e-5, 0.5):
        bits = gdn.float_bits(eps)
        assert np.array([bits], np.int32).view(np.float32)[0] == np.float32(eps)


def test_supports_only_with_a_kernel_backend_and_fitting_shapes(monkeypatch) -> None:
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    dims = {k: heads[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")}
    ci, cw, st = args["conv_in"], args["conv_weight"], args["state"]
    if backend() is None:
        assert not gdn.supports(ci, cw, st, **dims)
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    assert gdn.supports(ci, cw, st, **dims)
    assert gdn.supports(ci, cw, None, **dims)
    assert not gdn.supports(ci, cw, st.astype(mx.float16), **dims)  # state must be float32
    assert not gdn.supports(ci.astype(mx.int32), cw, st, **dims)
    assert not gdn.supports(ci, cw, st, **dict(dims, head_k_dim=48))  # not a multiple of 32
    assert not gdn.supports(ci, cw, st, **dict(dims, head_k_dim=512))
    long_in = mx.zeros((1, 3 + gdn.MAX_KERNEL_T + 1, ci.shape[2]))
    assert not gdn.supports(long_in, cw, st, **dims)  # past MAX_KERNEL_T: the op path


def test_dispatch_uses_kernel_only_when_supported(monkeypatch) -> None:
    calls = []
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    ref = gdn.gdn_step_reference(**args, **heads)

    def fake_run(kind, plan, inputs):
        calls.append((kind, plan))
        return ref

    monkeypatch.setattr(gdn, "run_kernel", fake_run)
    monkeypatch.setattr(gdn, "kernel_works", lambda kind: True)
    monkeypatch.setattr(gdn, "backend", lambda: None)
    out = gdn.gdn_step(**args, **heads)
    assert not calls and mx.array_equal(out[0], ref[0]).item()
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    gdn.gdn_step(**args, **heads)
    kind, plan = calls[-1]
    assert kind == "cuda" and plan.output_shapes == ((1, 2, 64), (1, 2, 32, 32))
    assert dict(plan.template)["HAS_MASK"] is False and dict(plan.template)["NT"] == 2
    gdn.gdn_step(**dict(args, state=args["state"].astype(mx.float16)), **heads)
    assert len(calls) == 1  # unsupported state dtype: reference


@pytest.mark.parametrize(
    "field,bad,message",
    [
        ("conv_in", (1, 6, 192), "conv_in must be"),
        ("state", (1, 2, 32, 64), "state must be"),
        ("a", (1, 2, 3), "a must be"),
        ("z", (1, 2, 2, 16), "z must be"),
        ("norm_weight", (64,), "norm_weight must be"),
        ("conv_weight", (100, 4, 1), "conv_weight must be"),
    ],
)
def test_wrong_shapes_raise_a_clear_error(field: str, bad: tuple, message: str) -> None:
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    args[field] = mx.zeros(bad)
    with pytest.raises(gdn.GdnShapeError, match=message):
        gdn.gdn_step(**args, **heads)


def test_view_past_the_projection_raises() -> None:
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    proj = mx.zeros((1, 2, 70))
    with pytest.raises(gdn.GdnShapeError, match="z view"):
        gdn.gdn_step(**dict(args, z=gdn.HeadView(proj, 8, 2)), **heads)  # needs columns 8..71
    with pytest.raises(gdn.GdnShapeError, match="b.array must be"):
        gdn.gdn_step(**dict(args, b=gdn.HeadView(mx.zeros((1, 3, 70)), 0, 2)), **heads)


def test_bad_mask_and_head_layout_raise() -> None:
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    with pytest.raises(gdn.GdnShapeError, match="mask must be"):
        gdn.gdn_step(**args, **dict(heads, mask=mx.ones((1, 3), mx.bool_)))
    with pytest.raises(gdn.GdnShapeError, match="head layout"):
        gdn.gdn_step(**args, **dict(heads, num_k_heads=3, num_v_heads=2))


def test_gdn_step_equals_reference_off_gpu() -> None:
    args, heads = make_inputs(2, 3, 1, 2, 32, 32, mask=mx.array([[True, True, False], [True, True, True]]))
    if backend() is None:
        for got, ref in zip(
            gdn.gdn_step(**args, **heads), gdn.gdn_step_reference(**args, **heads), strict=True
        ):
            assert mx.array_equal(got, ref).item()


# ----------------------------------------------------------------------- nvcc compile


def _render(dtype, T: int, dk: int, dv: int | None = None, **config) -> tuple[str, int]:
    """(MLX's translation unit, threads per block) of one launch of the CUDA kernel."""
    layouts = config.pop("layouts", None)
    args = dict(_config_args(dtype, T=T, dk=dk, dv=dv or dk), **config)
    template, _, group = gdn.launch_config("cuda", **args, layouts=layouts)
    inputs = [dtype, dtype, dtype, dtype, mx.float32, dtype, dtype, dtype, mx.float32, mx.bool_]
    return gdn.CUDA_KERNEL.render(inputs, [dtype, mx.float32], template), group[0]


PACKED = {"Z": (1234, 256 + 128, 2, 1024 + 8), "A": (1234, 1026, 2, 4), "B": (1234, 1024, 2, 4)}
VARIANTS = [
    *(
        (dtype, T, d)
        for dtype in (mx.bfloat16, mx.float16, mx.float32)
        for T in (1, 4, 16)
        for d in (128, 64)
    ),
    (mx.bfloat16, 8, 64, 256),  # other head shapes at the 32-floats-per-thread limit
    (mx.float32, 16, 256, 64),
    (mx.float32, gdn.MAX_T, 128),  # several shared-memory chunks
    (mx.bfloat16, gdn.MAX_T, 32),  # one warp per block
    (mx.bfloat16, 2, 128, 128, dict(has_mask=False, has_state=False)),
    (mx.bfloat16, 4, 128, 128, dict(layouts=PACKED)),  # z/a/b read from a fused projection
]


def one_translation_unit(sources: list[str]) -> str:
    """The variants in one file (MLX's shared prelude once, each kernel renamed `..._v<i>`): one
    nvcc run instead of one per variant."""
    marker = "namespace mlx::core::cu {"
    name = "custom_kernel_kapitsa_gdn_step"
    kernels = [
        marker + src.split(marker, 1)[1].replace(name, f"{name}_v{i}") for i, src in enumerate(sources)
    ]
    return "\n".join([sources[0].split(marker, 1)[0], *kernels])


def compile_with_resources(source: str) -> tuple[bool, str, dict[int, dict[str, int]]]:
    """nvcc to a sm_90 cubin with ptxas's resource report: (ok, log, {variant: usage})."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.cu"
        path.write_text(source)
        cmd = [nvcc(), "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", "-I", str(STUB)]
        proc = subprocess.run(
            [*cmd, "-o", str(path.with_suffix(".cubin")), str(path)],
            capture_output=True,
            text=True,
            timeout=600,
        )
    log = proc.stdout + proc.stderr
    usage: dict[int, dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '.*gdn_step_v(\d+)", line):
            current = int(m.group(1))
        elif current is not None and (m := re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)):
            usage.setdefault(current, {}).update(registers=int(m.group(1)), smem=int(m.group(2)))
        elif current is not None and (m := re.search(r"(\d+) bytes spill stores", line)):
            usage.setdefault(current, {})["spills"] = int(m.group(1))
    return proc.returncode == 0, log, usage


@pytest.mark.skipif(nvcc() is None, reason="nvcc not installed")
def test_every_cuda_variant_compiles_and_fits_an_sm() -> None:
    """No __launch_bounds__ (MLX writes the signature), so check what a launch needs: registers x
    threads within the SM's 64K registers, static shared memory under 48 KiB, no spills."""
    rendered = [_render(*v[:4], **(v[4] if len(v) > 4 else {})) for v in VARIANTS]
    ok, log, usage = compile_with_resources(one_translation_unit([src for src, _ in rendered]))
    assert ok, log[-4000:]
    assert "warning" not in log.lower(), log[-4000:]
    assert sorted(usage) == list(range(len(VARIANTS))), log[-4000:]
    for i, (_, threads) in enumerate(rendered):
        assert usage[i]["registers"] * threads <= 65536, (VARIANTS[i], usage[i], threads)
        assert usage[i]["smem"] <= 48 * 1024 and usage[i]["spills"] == 0, (VARIANTS[i], usage[i])


@pytest.mark.skipif(nvcc() is None, reason="nvcc not installed")
def test_a_broken_variant_fails_the_combined_compile() -> None:
    """Negative control: one bad kernel among good ones is caught."""
    good, _ = _render(mx.bfloat16, 1, 128)
    bad = good.replace(
        "const int tn = min(TC, NT - t0);", "const int tn = min(TC, NT - t0) + undefined_symbol;"
    )
    assert bad != good
    ok, _ = compile_source(one_translation_unit([good, bad]))
    assert not ok


# ------------------------------------------- the CUDA body executed on the CPU (emulated)

# Host C++ around the kernel body: one std::thread per CUDA thread, blocks one after another,
# __syncthreads / __syncwarp as barriers, __shfl_xor_sync through a per-warp exchange buffer,
# __shared__ arrays as statics (shared by the block's threads). The CUDA headers' bf16/fp16 types
# work on the host, so every rounding runs as on the device.
EMULATOR_PRELUDE = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>
#include <vector_functions.h>
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <thread>
#include <vector>
#undef __device__
#define __device__
#undef __global__
#define __global__
#define __shared__ static
using std::min;
struct EmuDim { unsigned x = 0, y = 0, z = 0; };
thread_local EmuDim threadIdx, blockIdx;
struct EmuBlock {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  float exchange[32][32];
};
thread_local EmuBlock* emu = nullptr;
inline void __syncthreads() { emu->block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu->warps[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int o) {
  const int w = threadIdx.x / 32, l = threadIdx.x % 32;
  emu->exchange[w][l] = v;
  __syncwarp();
  const float r = emu->exchange[w][l ^ o];
  __syncwarp();
  return r;
}
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
// Metal spellings, for the .metal port (address-space qualifiers are stripped before compiling).
using bfloat16_t = __nv_bfloat16;
using half = __half;
using uint = unsigned;
using ushort = unsigned short;
thread_local EmuDim threadgroup_position_in_grid;
thread_local unsigned thread_index_in_threadgroup;
namespace metal {
enum class mem_flags { mem_threadgroup };
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
inline float abs(float x) { return std::fabs(x); }
inline float rsqrt(float x) { return 1.f / std::sqrt(x); }
template <typename A> inline A max(A a, A b) { return a > b ? a : b; }
template <typename A> inline A min(A a, A b) { return a < b ? a : b; }
inline float simd_shuffle_xor(float v, ushort o) { return __shfl_xor_sync(0xffffffffu, v, o); }
}  // namespace metal
inline void threadgroup_barrier(metal::mem_flags) { __syncthreads(); }
template <typename To, typename From>
inline To as_type(From x) { To t; std::memcpy(&t, &x, sizeof t); return t; }
static std::vector<char> emu_read(const char* path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
"""


def cuda_translation(kernel, input_dtypes, output_dtypes, template) -> tuple[str, str]:
    """(source, function name): the rendered CUDA unit without MLX's includes."""
    body = kernel.render(input_dtypes, output_dtypes, template)
    body = body.split("\n", 3)[3]  # drop MLX's includes and `#define inf`
    return body.replace(
        "namespace cg = cooperative_groups;\n", ""
    ), f"mlx::core::cu::custom_kernel_{kernel.name}"


def metal_translation(kernel, input_dtypes, output_dtypes, template) -> tuple[str, str]:
    """(source, function name): the .metal header and body as host C++. Arrays declared
    `threadgroup` become statics (shared by the block's threads); other address-space qualifiers
    go; template arguments become constants as MLX's instantiation would bind them."""
    header, body = read_source(kernel.filename)
    body = re.sub(r"\bthreadgroup (\w+ \w+\[)", r"static \1", body)
    strip = r"\b(threadgroup|device|thread|constant) "
    header, body = re.sub(strip, "", header), re.sub(strip, "", body)
    params = [f"const {cuda_type(d)}* {n}" for n, d in zip(kernel.input_names, input_dtypes, strict=True)]
    params += [f"{cuda_type(d)}* {n}" for n, d in zip(kernel.output_names, output_dtypes, strict=True)]
    consts = []
    for name, value in template:
        if isinstance(value, bool):
            consts.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            consts.append(f"  constexpr int {name} = {value};")
        else:
            consts.append(f"  using {name} = {cuda_type(value)};")
    fn = "void emu_metal_kernel(" + ", ".join(params) + ") {\n" + "\n".join(consts) + body + "\n}\n"
    return header + fn, "emu_metal_kernel"


def emulator_source(
    unit: str, function: str, input_dtypes, output_dtypes, output_sizes, blocks, threads
) -> str:
    """EMULATOR_PRELUDE + a translated kernel + a main() that reads inputs from in<i>.bin, runs
    every block (one host thread per GPU thread) and writes out<i>.bin."""
    types = [f"const {cuda_type(d)}" for d in input_dtypes] + [cuda_type(d) for d in output_dtypes]
    n_in = len(input_dtypes)
    loads = "\n".join(f'  auto in{i} = emu_read("in{i}.bin");' for i in range(n_in))
    allocs = "\n".join(f"  std::vector<char> out{i}({size});" for i, size in enumerate(output_sizes))
    ptrs = [f"({types[i]}*)in{i}.data()" for i in range(n_in)]
    ptrs += [f"({types[n_in + i]}*)out{i}.data()" for i in range(len(output_sizes))]
    saves = "\n".join(
        f'  std::ofstream("out{i}.bin", std::ios::binary).write(out{i}.data(), {size});'
        for i, size in enumerate(output_sizes)
    )
    main = f"""
int main() {{
{loads}
{allocs}
  for (unsigned b = 0; b < {blocks}; ++b) {{
    EmuBlock block;
    block.block = std::make_unique<std::barrier<>>({threads});
    for (int w = 0; w < {threads // 32}; ++w) block.warps.push_back(std::make_unique<std::barrier<>>(32));
    std::vector<std::thread> pool;
    for (unsigned t = 0; t < {threads}; ++t) {{
      pool.emplace_back([&, t] {{
        emu = &block;
        threadIdx.x = thread_index_in_threadgroup = t;
        blockIdx.x = threadgroup_position_in_grid.x = b;
        {function}({", ".join(ptrs)});
      }});
    }}
    for (auto& th : pool) th.join();
  }}
{saves}
}}
"""
    return EMULATOR_PRELUDE + unit + main


_NP_TYPES = {mx.float32: np.float32, mx.uint32: np.uint32, mx.int32: np.int32}


class Emulated:
    """Stands in for gdn.CUDA_KERNEL / gdn.METAL_KERNEL: same call, runs the kernel's own source
    on the CPU through g++ (`translate` is cuda_translation or metal_translation)."""

    def __init__(self, kernel, translate, workdir: pathlib.Path):
        self.kernel, self.translate, self.workdir = kernel, translate, workdir

    def __call__(self, inputs, *, template, grid, threadgroup, output_shapes, output_dtypes, **_):
        threads = threadgroup[0]
        sizes = [int(np.prod(s)) * d.size for s, d in zip(output_shapes, output_dtypes, strict=True)]
        dtypes = [x.dtype for x in inputs]
        unit, function = self.translate(self.kernel, dtypes, output_dtypes, template)
        src = emulator_source(unit, function, dtypes, output_dtypes, sizes, grid[0] // threads, threads)
        run = self.workdir / f"run{len(list(self.workdir.iterdir()))}"
        run.mkdir()
        (run / "k.cpp").write_text(src)
        cc = ["g++", "-std=c++20", "-O1", "-w", "-pthread", "-I/usr/local/cuda/include", "k.cpp", "-o", "k"]
        proc = subprocess.run(cc, cwd=run, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        for i, x in enumerate(inputs):
            raw = x.view(mx.uint16) if x.dtype in (mx.bfloat16, mx.float16) else x
            np.array(raw).tofile(run / f"in{i}.bin")
        proc = subprocess.run(["./k"], cwd=run, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        outs = []
        for i, (shape, dtype) in enumerate(zip(output_shapes, output_dtypes, strict=True)):
            if dtype in (mx.bfloat16, mx.float16):
                raw = np.fromfile(run / f"out{i}.bin", np.uint16)
                outs.append(mx.array(raw).view(dtype).reshape(shape))
            else:
                raw = np.fromfile(run / f"out{i}.bin", _NP_TYPES.get(dtype, np.float32))
                outs.append(mx.array(raw).reshape(shape))
        return outs


EMULATION_SPECS = {  # name: (B, T, Hk, Hv, Dk, Dv, dtype, layout, masked, state, shared budget)
    "one-warp-no-state-f32": (2, 5, 1, 2, 32, 32, mx.float32, "plain", True, False, None),
    "grouped-chunked-f32": (2, 7, 2, 4, 64, 32, mx.float32, "plain", True, True, 2 * (4 * 160 + 12)),
    "bf16-qwen3next-views": (2, 3, 2, 4, 64, 64, mx.bfloat16, "qwen3_next", True, True, None),
    "real-head-dims-bf16": (1, 2, 1, 2, 128, 128, mx.bfloat16, "plain", True, True, None),
    "f16-qwen3_5-views": (1, 2, 1, 2, 96, 32, mx.float16, "qwen3_5", False, True, None),
}


def emulation_cases(fast: set[str]) -> list:
    """The specs as params; those not in `fast` are marked slow (each costs a g++ build and a run)."""
    return [
        pytest.param(*spec, id=name, marks=[] if name in fast else [pytest.mark.slow])
        for name, spec in EMULATION_SPECS.items()
    ]


EMULATION_CASES = emulation_cases(set(EMULATION_SPECS) - {"f16-qwen3_5-views"})
METAL_EMULATION_CASES = emulation_cases({"bf16-qwen3next-views"})  # same port: one case by default


def emulation_inputs(B, T, hk, hv, dk, dv, dtype, layout, masked, state) -> tuple[dict, dict, dict]:
    """(kernel args, heads, plain args for the reference) of one emulation case."""
    mask = mx.random.bernoulli(0.6, (B, T)) if masked else None
    args, heads = make_inputs(B, T, hk, hv, dk, dv, dtype=dtype, mask=mask, seed=5, state=state)
    plain = args
    if layout != "plain":
        views = embed_in_projection(args, packed=layout == "qwen3_next", hk=hk, hv=hv, dk=dk, dv=dv)
        cast = {
            k: gdn.HeadView(v.array.astype(dtype), v.offset, v.group, v.group_stride)
            for k, v in views.items()
        }
        args = dict(args, **cast)
    return args, heads, plain


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize("B,T,hk,hv,dk,dv,dtype,layout,masked,state,budget", EMULATION_CASES)
def test_cuda_body_emulated_on_cpu_matches_reference(
    B, T, hk, hv, dk, dv, dtype, layout, masked, state, budget, monkeypatch, tmp_path
) -> None:
    """gdn_step's real launch path with the real CUDA body, executed by host threads."""
    args, heads, plain = emulation_inputs(B, T, hk, hv, dk, dv, dtype, layout, masked, state)
    ref_out, ref_state = gdn.gdn_step_reference(**plain, **heads)
    mask = heads["mask"]
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "kernel_works", lambda kind: True)
    monkeypatch.setattr(gdn, "CUDA_KERNEL", Emulated(gdn.CUDA_KERNEL, cuda_translation, tmp_path))
    if budget is not None:  # force several shared-memory chunks
        monkeypatch.setitem(gdn.SHARED_BUDGET, "cuda", budget)
    out, new_state = gdn.gdn_step(**args, **heads)
    assert len(list(tmp_path.iterdir())) == 1  # the kernel ran, not the reference
    assert_close(out, ref_out, dtype, fp32_tol=1e-5)
    assert_close(new_state, ref_state, dtype, fp32_tol=1e-5)
    if mask is not None:
        assert mx.array_equal(mx.where(mask[..., None], 0, out), mx.zeros_like(out)).item()


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize("B,T,hk,hv,dk,dv,dtype,layout,masked,state,budget", METAL_EMULATION_CASES)
def test_metal_body_emulated_on_cpu_matches_reference(
    B, T, hk, hv, dk, dv, dtype, layout, masked, state, budget, monkeypatch, tmp_path
) -> None:
    """The .metal port's logic, executed as host C++ the same way (its Metal compilation and
    Apple-GPU behaviour stay unverified here)."""
    args, heads, plain = emulation_inputs(B, T, hk, hv, dk, dv, dtype, layout, masked, state)
    ref_out, ref_state = gdn.gdn_step_reference(**plain, **heads)
    monkeypatch.setattr(gdn, "backend", lambda: "metal")
    monkeypatch.setattr(gdn, "kernel_works", lambda kind: True)
    monkeypatch.setattr(gdn, "METAL_KERNEL", Emulated(gdn.METAL_KERNEL, metal_translation, tmp_path))
    if budget is not None:
        monkeypatch.setitem(gdn.SHARED_BUDGET, "metal", budget)
    out, new_state = gdn.gdn_step(**args, **heads)
    assert len(list(tmp_path.iterdir())) == 1
    assert_close(out, ref_out, dtype, fp32_tol=1e-5)
    assert_close(new_state, ref_state, dtype, fp32_tol=1e-5)


@pytest.fixture
def fresh_probe():
    gdn.kernel_works.cache_clear()
    yield
    gdn.kernel_works.cache_clear()


class BrokenKernel:
    def __init__(self, result=None):
        self.result = result

    def __call__(self, inputs, *, output_shapes, output_dtypes, **_):
        if self.result is None:
            raise RuntimeError("nvrtc: error: identifier 'x' is undefined")
        return [mx.full(s, self.result, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]


@pytest.mark.parametrize("result", [None, 0.5])
def test_a_kernel_that_fails_or_disagrees_is_not_used(result, monkeypatch, fresh_probe, caplog) -> None:
    """It raises at evaluation or returns wrong numbers: gdn_step keeps to the reference."""
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "CUDA_KERNEL", BrokenKernel(result))
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    out, state = gdn.gdn_step(**args, **heads)
    ref_out, ref_state = gdn.gdn_step_reference(**args, **heads)
    assert mx.array_equal(out, ref_out).item() and mx.array_equal(state, ref_state).item()
    assert not gdn.kernel_works("cuda") and "fused GDN step kernel" in caplog.text


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
def test_a_working_kernel_passes_the_probe(monkeypatch, fresh_probe, tmp_path) -> None:
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "CUDA_KERNEL", Emulated(gdn.CUDA_KERNEL, cuda_translation, tmp_path))
    state = mx.random.state[0]
    assert gdn.kernel_works("cuda")
    assert mx.array_equal(state, mx.random.state[0]).item()  # the probe leaves the global seed alone


# ------------------------------------------------------------------- Metal source sanity


def test_metal_source_declares_what_the_launcher_passes() -> None:
    header, body = read_source(gdn.METAL_KERNEL.filename)
    template, _, _ = gdn.launch_config("metal", **_config_args(mx.bfloat16, T=4, dk=128, dv=128))
    for name, _ in template:
        assert name in body, name
    for name in gdn.INPUT_NAMES + gdn.OUTPUT_NAMES:
        assert name in body, name
    assert "gdn_simd_sum" in header and "thread_index_in_threadgroup" in body


# ----------------------------------------------------------------- kernels on a device


def _device_cases():
    for shape in SHAPES:
        for B in (1, 3):
            for T in (1, 2, 8):
                for dtype in (mx.bfloat16, mx.float32):
                    for masked in (False, True):
                        yield shape, B, T, dtype, masked


def use_exact_conv(monkeypatch, dtype) -> None:
    """float32 comparisons on a GPU: MLX may run float32 convolutions (mx.conv1d, the model's path
    for T > 1) as TF32 (MLX_ENABLE_TF32 defaults to 1), ~1e-3 off; the reference then takes the
    plain multiply-add conv, the math the kernel does in float32."""
    if dtype == mx.float32:
        monkeypatch.setattr(gdn, "causal_conv", causal_conv_reference)


def _compare_on_device(shape: str, B: int, T: int, dtype, masked: bool, monkeypatch) -> None:
    use_exact_conv(monkeypatch, dtype)
    hk, hv, dk, dv = SHAPES[shape]
    mask = None
    if masked:  # any pattern: right padding, replayed prefixes, a fully masked row
        mx.random.seed(T)
        mask = mx.random.bernoulli(0.6, (B, T))
    args, heads = make_inputs(B, T, hk, hv, dk, dv, dtype=dtype, mask=mask, seed=B * 100 + T)
    dims = {k: heads[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")}
    assert gdn.supports(args["conv_in"], args["conv_weight"], args["state"], **dims)
    assert gdn.kernel_works(backend()), "the kernel failed its probe (see the warning logged)"
    out, state = gdn.gdn_step(**args, **heads)
    ref_out, ref_state = gdn.gdn_step_reference(**args, **heads)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape and state.shape == ref_state.shape
    assert_close(out, ref_out, dtype)
    assert_close(state, ref_state, dtype)
    if masked:
        assert mx.array_equal(mx.where(mask[..., None], 0, out), mx.zeros_like(out)).item()


@pytest.mark.gpu
@pytest.mark.parametrize("shape,B,T,dtype,masked", list(_device_cases()))
def test_cuda_gdn_step_matches_reference(shape, B, T, dtype, masked, monkeypatch) -> None:
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    _compare_on_device(shape, B, T, dtype, masked, monkeypatch)


@pytest.mark.gpu
def test_cuda_gdn_step_without_state_and_long_chunks(monkeypatch) -> None:
    """No incoming state (first step); T = MAX_T (several shared-memory chunks) with other head
    dims at the register limit."""
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    use_exact_conv(monkeypatch, mx.float32)
    cases = (
        (2, 3, 16, 48, 128, 128, False),
        (1, gdn.MAX_T, 2, 4, 64, 256, True),
        (2, 5, 1, 3, 256, 64, True),
        (2, 40, 1, 2, 32, 32, True),  # one warp per block, more tokens than threads
    )
    for B, T, hk, hv, dk, dv, state in cases:
        args, heads = make_inputs(B, T, hk, hv, dk, dv, state=state, seed=T)
        dims = {k: heads[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")}
        assert gdn.supports(args["conv_in"], args["conv_weight"], args["state"], **dims)
        assert gdn.kernel_works("cuda"), "the kernel failed its probe (see the warning logged)"
        out, new_state = gdn.gdn_step(**args, **heads)
        ref_out, ref_state = gdn.gdn_step_reference(**args, **heads)
        assert rel_err(out, ref_out) < 1e-4 and rel_err(new_state, ref_state) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_cuda_gdn_step_reads_projection_views(packed: bool, dtype) -> None:
    """z, b, a read in place from a fused in-projection give the same result as plain arrays."""
    if backend() != "cuda":
        pytest.skip("needs the CUDA backend")
    hk, hv, dk, dv = SHAPES["4b"]
    args, heads = make_inputs(3, 4, hk, hv, dk, dv, dtype=dtype, seed=11)
    views = embed_in_projection(args, packed=packed, hk=hk, hv=hv, dk=dk, dv=dv)
    views = {
        k: gdn.HeadView(v.array.astype(dtype), v.offset, v.group, v.group_stride) for k, v in views.items()
    }
    assert gdn.kernel_works("cuda"), "the kernel failed its probe (see the warning logged)"
    plain = gdn.gdn_step(**args, **heads)
    viewed = gdn.gdn_step(**dict(args, **views), **heads)
    assert mx.array_equal(plain[0], viewed[0]).item() and mx.array_equal(plain[1], viewed[1]).item()


@pytest.mark.metal
@pytest.mark.parametrize("shape,B,T,dtype,masked", list(_device_cases()))
def test_metal_gdn_step_matches_reference(shape, B, T, dtype, masked, monkeypatch) -> None:
    if backend() != "metal":
        pytest.skip("needs the Metal backend")
    _compare_on_device(shape, B, T, dtype, masked, monkeypatch)


# ------------------------------------------------------------- the decode variant (gdn_decode)


def _decode_inputs(B, T, hk, hv, dk, dv, dtype, extra_columns, seed=7):
    """gdn_step's inputs split as a decode step has them: the conv state, and the new rows as the
    first C columns of a wider projection output (x_new), plus the concatenated conv_in."""
    args, heads = make_inputs(B, T, hk, hv, dk, dv, dtype=dtype, seed=seed)
    heads.pop("mask")
    conv_in = args.pop("conv_in")
    K = args["conv_weight"].shape[1]
    conv_state, rows = conv_in[:, : K - 1], conv_in[:, K - 1 :]
    x_new = mx.concatenate([rows, mx.random.normal((B, T, extra_columns)).astype(dtype)], axis=-1)
    return conv_state, x_new, conv_in, args, heads


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
@pytest.mark.parametrize(
    "B,T,hk,hv,dk,dv,dtype,extra",
    [
        (1, 1, 1, 2, 32, 32, mx.float32, 24),  # decode: one token, a wider projection
        (2, 3, 2, 4, 32, 64, mx.bfloat16, 0),  # short chain, two key heads shared by value heads
    ],
)
def test_decode_variant_emulated_matches_the_concatenating_path(
    B, T, hk, hv, dk, dv, dtype, extra, monkeypatch, tmp_path
) -> None:
    """gdn_decode's CUDA launch (the real body, host threads): the same out and state as gdn_step
    on the concatenated window, and the window's last K-1 rows as the next conv state, exactly."""
    conv_state, x_new, conv_in, args, heads = _decode_inputs(B, T, hk, hv, dk, dv, dtype, extra)
    ref_out, ref_state = gdn.gdn_step_reference(conv_in, **args, **heads)
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "decode_kernel_works", lambda kind: True)
    monkeypatch.setattr(
        gdn, "CUDA_DECODE_KERNEL", Emulated(gdn.CUDA_DECODE_KERNEL, cuda_translation, tmp_path)
    )
    out, conv_out, new_state = gdn.gdn_decode(conv_state, x_new, *args.values(), **heads)
    assert len(list(tmp_path.iterdir())) == 1  # the kernel ran, not the fallback
    assert_close(out, ref_out, dtype, fp32_tol=1e-5)
    assert_close(new_state, ref_state, dtype, fp32_tol=1e-5)
    assert conv_out.dtype == conv_state.dtype and mx.array_equal(conv_out, conv_in[:, T:]).item()


def test_decode_variant_falls_back_to_concatenating_off_cuda() -> None:
    conv_state, x_new, conv_in, args, heads = _decode_inputs(1, 1, 1, 2, 32, 32, mx.float32, 8)
    out, conv_out, new_state = gdn.gdn_decode(conv_state, x_new, *args.values(), **heads)
    ref_out, ref_state = gdn.gdn_step(conv_in, **args, **heads)
    assert mx.array_equal(out, ref_out).item() and mx.array_equal(new_state, ref_state).item()
    assert mx.array_equal(conv_out, conv_in[:, 1:]).item()


@pytest.mark.skipif(nvcc() is None, reason="needs nvcc")
def test_decode_variant_compiles() -> None:
    conv_state, x_new, _, args, heads = _decode_inputs(1, 1, 16, 48, 128, 128, mx.bfloat16, 96, seed=1)
    window = gdn._Window((1, 4, conv_state.shape[2]), mx.bfloat16)
    plan = gdn.plan_for("cuda", (window, *args.values(), None), (16, 48, 128, 128), 1e-6)
    template = (*plan.template, ("X_ROW", x_new.shape[-1]), ("CT", mx.bfloat16))
    dtypes = [x.dtype for x in (conv_state, x_new, *args.values())] + [mx.bool_]
    src = gdn.CUDA_DECODE_KERNEL.render(dtypes, [mx.bfloat16, mx.float32, mx.bfloat16], template)
    assert_compiles(src)


@pytest.mark.gpu
@pytest.mark.skipif(backend() != "cuda", reason="needs the CUDA backend")
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_gpu_decode_variant_matches_the_concatenating_path(shape, dtype, monkeypatch) -> None:
    use_exact_conv(monkeypatch, dtype)
    hk, hv, dk, dv = SHAPES[shape]
    assert gdn.decode_kernel_works("cuda"), "the decode variant failed its probe (see the warning logged)"
    conv_state, x_new, conv_in, args, heads = _decode_inputs(1, 1, hk, hv, dk, dv, dtype, 100)
    out, conv_out, new_state = gdn.gdn_decode(conv_state, x_new, *args.values(), **heads)
    ref_out, ref_state = gdn.gdn_step(conv_in, **args, **heads)
    assert_close(out, ref_out, dtype, fp32_tol=1e-5)
    assert_close(new_state, ref_state, dtype, fp32_tol=1e-5)
    assert mx.array_equal(conv_out, conv_in[:, 1:]).item()


@pytest.mark.skipif(shutil.which("g++") is None or nvcc() is None, reason="needs g++ and the CUDA headers")
def test_decode_variant_probe_passes_with_the_real_body_and_fails_a_broken_one(monkeypatch, tmp_path) -> None:
    """decode_kernel_works on CUDA: the emulated real body agrees with the concatenating path
    (out, next conv state, state); a kernel that raises or returns wrong numbers is not used."""
    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "kernel_works", lambda kind: True)
    monkeypatch.setattr(
        gdn, "CUDA_DECODE_KERNEL", Emulated(gdn.CUDA_DECODE_KERNEL, cuda_translation, tmp_path)
    )
    gdn.decode_kernel_works.cache_clear()
    try:
        assert gdn.decode_kernel_works("cuda")
        for result in (None, 0.5):
            gdn.decode_kernel_works.cache_clear()
            monkeypatch.setattr(gdn, "CUDA_DECODE_KERNEL", BrokenKernel(result))
            assert not gdn.decode_kernel_works("cuda")
    finally:
        gdn.decode_kernel_works.cache_clear()
