"""gdn_chain: the fused GDN kernel for any token count (prefill, verification), by padding to a
power of two with the padded tokens masked out. The kernel itself is tested in test_gdn_kernel.py;
here the padding must be invisible: a stand-in 'kernel' that runs the reference on exactly what
the launch would get must reproduce the unpadded reference."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kapitsa.engine.kernels import gdn, gdn_plan, gdn_reference
from kapitsa.engine.kernels.gdn_prefill import gdn_chain, padded_length
from tests.kernels.test_gdn_reference import make_inputs


def test_padded_length_is_exact_up_to_max_t_then_a_power_of_two() -> None:
    assert [padded_length(t) for t in (1, 7, gdn_plan.MAX_T)] == [1, 7, gdn_plan.MAX_T]
    longer = (gdn_plan.MAX_T + 1, 40, 100, 128, 129, 513)
    assert [padded_length(t) for t in longer] == [32, 64, 128, 128, 256, 1024]


def _fake_kernel(monkeypatch) -> list:
    """Route gdn_step's launches to the reference run on the launch's own (padded) inputs."""
    launches = []

    def run(kind, plan, inputs):
        launches.append(dict(plan.template)["NT"])
        conv_in, conv_w, a, b, A_log, dt_bias, z, norm_w, state, mask = inputs
        hk, hv, dk, dv = (dict(plan.template)[k] for k in ("HK", "HV", "DK", "DV"))
        return gdn_reference.gdn_step_reference(
            conv_in, conv_w, a, b, A_log, dt_bias, z, norm_w, state,
            num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, norm_eps=1e-6, mask=mask,
        )  # fmt: skip

    monkeypatch.setattr(gdn, "backend", lambda: "cuda")
    monkeypatch.setattr(gdn, "kernel_works", lambda kind: True)
    monkeypatch.setattr(gdn, "run_kernel", run)
    return launches


@pytest.mark.parametrize(
    "T,masked,state", [(100, False, True), (77, True, True), (130, False, False), (40, False, True)]
)
def test_padding_is_invisible(monkeypatch, T: int, masked: bool, state: bool) -> None:
    mask = None
    if masked:  # two rows, the second right-padded after 50 tokens
        mask = mx.concatenate([mx.ones((1, T), mx.bool_), (mx.arange(T) < 50)[None]], axis=0)
    args, heads = make_inputs(2 if masked else 1, T, 2, 4, 32, 32, mask=mask, state=state)
    ref_out, ref_state = gdn_reference.gdn_step_reference(**args, **heads)
    launches = _fake_kernel(monkeypatch)
    out, new_state = gdn_chain(**args, **heads)
    assert launches == [padded_length(T)]
    assert out.shape == ref_out.shape and new_state.shape == ref_state.shape
    assert mx.allclose(out, ref_out, atol=1e-5).item()
    assert mx.allclose(new_state, ref_state, atol=1e-5).item()


def test_without_a_kernel_it_is_the_reference() -> None:
    args, heads = make_inputs(1, 70, 1, 2, 32, 32)
    ref = gdn_reference.gdn_step_reference(**args, **heads)
    got = gdn_chain(**args, **heads)
    assert all(mx.array_equal(g, r).item() for g, r in zip(got, ref, strict=True))


def test_past_the_kernel_limit_it_is_the_reference(monkeypatch) -> None:
    launches = _fake_kernel(monkeypatch)
    monkeypatch.setattr(gdn_plan, "MAX_KERNEL_T", 96)
    gdn_plan._plan.cache_clear()
    args, heads = make_inputs(1, 70, 1, 2, 32, 32)  # pads to 128 > 96: no launch
    gdn_chain(**args, **heads)
    gdn_plan._plan.cache_clear()
    assert launches == []
