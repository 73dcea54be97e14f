"""The chunked CPU gated delta rule (kernels/cpu_gdn.py) against the sequential reference: chunk
boundaries, grouped heads, a carried-in state, strong decays and masked (padded) positions."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine.kernels.cpu_gdn import CHUNK, gated_delta_chunked
from kapitsa.engine.ops.gated_delta import gated_delta, gated_delta_reference, l2norm_qk


def _inputs(B: int, T: int, Hk: int, Hv: int, D: int, *, strong_decay: bool = False):
    keys = mx.random.split(mx.random.key(3), 6)
    q, k = l2norm_qk(
        mx.random.normal((B, T, Hk, D), key=keys[0]), mx.random.normal((B, T, Hk, D), key=keys[1])
    )
    v = mx.random.normal((B, T, Hv, D), key=keys[2])
    low = 0.05 if strong_decay else 0.7
    g = mx.random.uniform(low, 1.0, (B, T, Hv), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv), key=keys[4])
    state = 0.3 * mx.random.normal((B, Hv, D, D), key=keys[5])
    return q, k, v, g, beta, state


def _close(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a - b).max() / (mx.abs(b).max() + 1e-6))


@pytest.mark.parametrize("T", [1, CHUNK - 1, CHUNK, 2 * CHUNK + 5, 300])
@pytest.mark.parametrize(("Hk", "Hv"), [(2, 2), (2, 4)])
def test_matches_the_sequential_reference(on_cpu, T: int, Hk: int, Hv: int) -> None:
    inputs = _inputs(2, T, Hk, Hv, 16)
    y_ref, s_ref = gated_delta_reference(*inputs)
    y, s = gated_delta_chunked(*inputs)
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    assert _close(y, y_ref) < 1e-4 and _close(s, s_ref) < 1e-4


def test_strong_decays_stay_exact(on_cpu) -> None:
    inputs = _inputs(1, 200, 2, 2, 16, strong_decay=True)
    y_ref, s_ref = gated_delta_reference(*inputs)
    y, s = gated_delta_chunked(*inputs)
    assert _close(y, y_ref) < 1e-4 and _close(s, s_ref) < 1e-4


def test_masked_positions_leave_the_state_and_yield_zero(on_cpu) -> None:
    inputs = _inputs(2, 150, 2, 4, 16)
    mask = mx.arange(150)[None, :] < mx.array([150, 97])[:, None]  # row 1 right-padded
    y_ref, s_ref = gated_delta_reference(*inputs, mask=mask)
    y, s = gated_delta_chunked(*inputs, mask=mask)
    assert _close(y, y_ref) < 1e-4 and _close(s, s_ref) < 1e-4
    assert float(mx.abs(y[1, 97:]).max()) == 0.0


def test_the_op_takes_it_for_long_chains_on_the_cpu(on_cpu) -> None:
    inputs = _inputs(1, 100, 2, 2, 16)
    y_ref, s_ref = gated_delta_reference(*inputs)
    y, s = gated_delta(*inputs)
    assert _close(y, y_ref) < 1e-4 and _close(s, s_ref) < 1e-4
