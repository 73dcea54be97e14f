"""The fused Gated DeltaNet step's algorithm and launch, without a GPU: a NumPy transcription of
the kernel (channel mapping, chunking, lane column layout, mask, norm) against the reference,
launch configurations within their limits (kernels/gdn_plan.py), dispatch and its fallback, and
every CUDA variant compiled with nvcc. The emulated bodies are in test_gdn_emulated.py, the
kernels on a device in test_gdn_device.py."""

from __future__ import annotations

import pathlib
import re
import subprocess
import tempfile

import mlx.core as mx
import numpy as np
import pytest
from nvcc_check import compile_source, include_args, nvcc

from kapitsa.engine.kernels import backend, gdn, gdn_plan, gdn_reference
from tests.kernels.test_gdn_reference import make_inputs

# --------------------------------------------- NumPy transcription of the kernel's algorithm


def _np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def kernel_transcription(args: dict, heads: dict, *, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """The CUDA/Metal body step by step in float32 (fp32 inputs, so its roundings are identities):
    per block (row bi, head h) phases 1-4 per chunk of `chunk` tokens, the state held as lanes'
    column slots (gdn_col) to pin the layout."""
    views = {k: v for k, v in args.items() if isinstance(v, gdn_reference.HeadView)}
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
        v = views.get(name, gdn_reference.HeadView(None, 0, hv, 0))
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
    z, b, a = gdn_reference.projection_views(
        mx.zeros((B, T, n)), packed=packed, num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv
    )
    for view, name, width in ((z, "z", dv), (b, "b", 1), (a, "a", 1)):
        proj[..., np.array(view.columns(hv, width))] = np.array(args[name].astype(mx.float32)).reshape(
            B, T, -1
        )
    proj = mx.array(proj)
    views = gdn_reference.projection_views(
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
    ref_out, ref_state = gdn_reference.gdn_step_reference(**args, **heads)
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
    monkeypatch.setattr(gdn_plan, "backend", lambda: kind)
    for dk in range(32, 257, 32):
        for dv in range(32, 257, 32):
            warps = gdn_plan.warps_for(dk, dv, gdn_plan.MAX_WARPS[kind])
            assert dv % warps == 0 and warps * 32 <= 1024
            template, grid, group = gdn_plan.launch_config(
                kind, **_config_args(mx.bfloat16, T=64, dk=dk, dv=dv)
            )
            values = dict(template)
            shared = values["TC"] * (4 * (2 * dk + dv) + 12)
            assert shared <= gdn_plan.SHARED_BUDGET[kind] and values["TC"] >= 1
            assert group == (warps * 32, 1, 1) and grid == (3 * 4 * warps * 32, 1, 1)
            rows, cols = dv // warps, dk // 32
            supported = gdn_plan.supports(
                mx.zeros((1, 4, 2 * dk + dv)),
                mx.zeros((2 * dk + dv, 4, 1)),
                None,
                **dict(num_k_heads=1, num_v_heads=1, head_k_dim=dk, head_v_dim=dv),
            )
            assert supported == (rows * cols <= gdn_plan.MAX_STATE_FLOATS) == (dk * dv <= 16384)
    # The real models' heads: 16 warps x 8 rows x 4 columns per thread, one chunk for T <= 16.
    template, _, _ = gdn_plan.launch_config("cuda", **_config_args(mx.bfloat16, T=16, dk=128, dv=128))
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
        bits = gdn_plan.float_bits(eps)
        assert np.array([bits], np.int32).view(np.float32)[0] == np.float32(eps)


def test_supports_only_with_a_kernel_backend_and_fitting_shapes(monkeypatch) -> None:
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    dims = {k: heads[k] for k in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim")}
    ci, cw, st = args["conv_in"], args["conv_weight"], args["state"]
    if backend() is None:
        assert not gdn_plan.supports(ci, cw, st, **dims)
    monkeypatch.setattr(gdn_plan, "backend", lambda: "cuda")
    assert gdn_plan.supports(ci, cw, st, **dims)
    assert gdn_plan.supports(ci, cw, None, **dims)
    assert not gdn_plan.supports(ci, cw, st.astype(mx.float16), **dims)  # state must be float32
    assert not gdn_plan.supports(ci.astype(mx.int32), cw, st, **dims)
    assert not gdn_plan.supports(ci, cw, st, **dict(dims, head_k_dim=48))  # not a multiple of 32
    assert not gdn_plan.supports(ci, cw, st, **dict(dims, head_k_dim=512))
    long_in = mx.zeros((1, 3 + gdn_plan.MAX_KERNEL_T + 1, ci.shape[2]))
    assert not gdn_plan.supports(long_in, cw, st, **dims)  # past MAX_KERNEL_T: the op path


def test_dispatch_uses_kernel_only_when_supported(monkeypatch) -> None:
    calls = []
    args, heads = make_inputs(1, 2, 1, 2, 32, 32)
    ref = gdn_reference.gdn_step_reference(**args, **heads)

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


# ----------------------------------------------------------------------- nvcc compile


def _render(dtype, T: int, dk: int, dv: int | None = None, **config) -> tuple[str, int]:
    """(MLX's translation unit, threads per block) of one launch of the CUDA kernel."""
    layouts = config.pop("layouts", None)
    args = dict(_config_args(dtype, T=T, dk=dk, dv=dv or dk), **config)
    template, _, group = gdn_plan.launch_config("cuda", **args, layouts=layouts)
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
    (mx.float32, 64, 128),  # several shared-memory chunks (a padded prefill call)
    (mx.bfloat16, 64, 32),  # one warp per block
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
        cmd = [nvcc(), "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", *include_args(tmp)]
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
