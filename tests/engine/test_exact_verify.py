"""KernelOptions.exact_verify: a verify forward's rows equal decode steps' bit for bit in bf16.

On the CPU every route is already row-invariant, so this checks the exact paths' own arithmetic
(attention one query row at a time over the keys its decode step sees, the logits row by row) and
that they are taken; tests/kernels/test_matvec_one_row.py checks the CUDA one-row kernel's rows
under the emulator, and `bash lab/h200_all.sh verify-diff` the whole forward on the GPU."""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_standins import tiny_model

from kapitsa.engine.models import base
from kapitsa.engine.options import KernelOptions
from kapitsa.engine.runner.model_runner import ModelRunner

PROMPT = [(7 * i) % 500 + 3 for i in range(37)]
DRAFT = [11, 250, 31, 499, 4, 77, 123, 9]


def _logits_both_ways(model) -> tuple[list[mx.array], mx.array]:  # noqa: ANN001
    runner = ModelRunner(model, kernels=KernelOptions(exact_verify=True))
    stepped, verified = model.make_cache(1), model.make_cache(1)
    runner.prefill(stepped, PROMPT)
    runner.prefill(verified, PROMPT)
    steps = [model(mx.array([[t]], dtype=mx.int32), stepped)[0, 0] for t in DRAFT]
    together = model(mx.array([DRAFT], dtype=mx.int32), verified, record=True)[0]
    mx.eval(steps, together)
    return steps, together


@pytest.mark.parametrize("kind", ["qwen3_5", "nemotron_h"])
def test_verify_rows_equal_decode_steps_in_bf16(kind: str, monkeypatch) -> None:
    calls = []
    attend = base.Attention._attend_as_decode_steps

    def spy(self, q, *args):  # noqa: ANN001, ANN202
        calls.append(q.shape[2])
        return attend(self, q, *args)

    monkeypatch.setattr(base.Attention, "_attend_as_decode_steps", spy)
    model = tiny_model(kind)
    model.set_dtype(mx.bfloat16)
    steps, together = _logits_both_ways(model)
    assert together.dtype == mx.bfloat16
    for t, step in enumerate(steps):
        assert mx.array_equal(step, together[t]).item(), f"row {t}"
    assert calls and set(calls) == {len(DRAFT)}  # every attention layer took the exact path


def test_exact_verify_gives_the_moe_layers_every_pair_the_kernels_take() -> None:
    """A verify's T tokens x k experts go through the decode step's expert kernels (which compute
    each token's pairs alike at any count) rather than past the pair limit to gather_qmm."""
    from kapitsa.engine.options import MOE_KERNEL_PAIRS

    assert KernelOptions(exact_verify=True).moe_pairs == MOE_KERNEL_PAIRS
    assert KernelOptions(moe_max_pairs=12).moe_pairs == 12
